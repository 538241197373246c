//! Remote references across in-process workers, over TCP and the in-memory transport. Every
//! test waits for quiescence at the end and checks that every constructed value was dropped
//! and nothing is left (owner values, user references, pending forks, confirmations).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use integration_tests::rref_fns::*;
use integration_tests::{each_transport, run, shutdown_all};
use rpc_core::testing::start_group;
use rpc_core::{Agent, Secret, Transport};
use rref::{RRef, RRefError};

static NS: AtomicU64 = AtomicU64::new(1);

/// A fresh namespace for live-value counting (tests run in parallel).
fn ns() -> u64 {
    NS.fetch_add(1, Ordering::Relaxed) + std::process::id() as u64 * 1_000_000
}

async fn group(n: u32, t: Transport, jitter: Duration) -> Vec<Agent> {
    let a = start_group(
        n,
        t,
        Secret::generate(),
        |_| registry(),
        |_, c| c.with_rpc_timeout(Duration::from_secs(20)),
    )
    .await
    .expect("group starts");
    for w in &a {
        rref::set_message_jitter(w, jitter);
    }
    a
}

/// Waits (bounded) until no worker owns, references or awaits anything, and `ns` has no live
/// value; panics with the counters otherwise.
async fn assert_quiescent(agents: &[Agent], ns: u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let infos: Vec<_> = agents.iter().map(rref::debug_info).collect();
        let idle = infos.iter().all(|d| *d == rref::DebugInfo::default());
        if idle && live(ns) == 0 {
            return;
        }
        if Instant::now() > deadline {
            panic!("not quiescent: live values {} counters {infos:?}", live(ns));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn remote_returns_at_once_and_to_here_fetches_the_value() {
    each_transport(60, |t| async move {
        let a = group(3, t, Duration::ZERO).await;
        let ns = ns();
        let start = Instant::now();
        let r = rref::remote(&a[0], "worker1", make_slow, (ns, 7, 300)).unwrap();
        assert!(
            start.elapsed() < Duration::from_millis(200),
            "remote must not wait for the owner"
        );
        assert!(!r.is_owner());
        assert_eq!(r.owner().0, 1);
        assert_eq!(r.owner_name(), "worker1");
        let v = r.to_here().await.unwrap();
        assert_eq!(v, Tracked::new(ns + 1_000_000_000, 7));
        assert!(!v.is_counted(), "to_here gives a copy");
        assert!(r.confirmed_by_owner());
        assert_eq!(live(ns), 1);
        drop(r);
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

/// `remote` queues its constructor before it returns (the connection being up), so the next
/// call its caller makes to the owner runs after the value was made: a fetch right after
/// `remote` finds the value instead of waiting for it.
#[test]
fn remote_queues_its_constructor_before_it_returns() {
    each_transport(60, |t| async move {
        let a = group(2, t, Duration::ZERO).await;
        let ns = ns();
        assert_eq!(a[0].rpc_async(1u32, live_now, (ns,)).await.unwrap(), 0);
        for i in 0..20 {
            let r = rref::remote(&a[0], 1u32, make, (ns, i)).unwrap();
            let seen = a[0].rpc_async(1u32, live_now, (ns,)).await.unwrap();
            assert_eq!(seen, 1, "round {i}: the call overtook the constructor");
            drop(r);
            let by = Instant::now() + Duration::from_secs(10);
            while live(ns) != 0 && Instant::now() < by {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert_eq!(live(ns), 0, "round {i}: the value outlived its reference");
        }
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

/// The blocking fetch, from threads that are not async: on a user (before and after the
/// owner confirmed it), on the owner, and for a constructor that failed.
#[test]
fn to_here_blocking_works_from_plain_threads() {
    each_transport(60, |t| async move {
        let a = group(2, t, Duration::ZERO).await;
        let ns = ns();
        let slow = rref::remote(&a[0], 1u32, make_slow, (ns, 3, 200)).unwrap();
        let owned = rref::remote(&a[1], 1u32, make, (ns, 4)).unwrap();
        let failed = rref::remote(&a[0], 1u32, make_fail, ("no disk".into(),)).unwrap();
        let (slow, owned, failed) = tokio::task::spawn_blocking(move || {
            // The owner has not confirmed the creator's reference yet: the fetch waits for
            // the constructor, and settles the reference.
            assert!(!slow.confirmed_by_owner());
            let v = slow.to_here_blocking().unwrap();
            assert_eq!(v, Tracked::new(ns + 1_000_000_000, 3));
            assert!(slow.confirmed_by_owner());
            assert_eq!(slow.to_here_blocking().unwrap().id, 3);
            assert!(owned.is_owner());
            assert_eq!(owned.to_here_blocking().unwrap().id, 4);
            match failed.to_here_blocking_timeout(Duration::from_secs(10)) {
                Err(RRefError::CreationFailed { message, .. }) => {
                    assert!(message.contains("no disk"), "{message}")
                }
                other => panic!("expected CreationFailed, got {other:?}"),
            }
            (slow, owned, failed)
        })
        .await
        .unwrap();
        assert_eq!(live(ns), 2);
        drop((slow, owned, failed));
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

#[test]
fn methods_run_on_the_owner_with_access_to_the_value() {
    each_transport(60, |t| async move {
        let a = group(3, t, Duration::ZERO).await;
        let ns = ns();
        let r = rref::remote(&a[0], 2u32, make, (ns, 5)).unwrap();
        assert_eq!(r.rpc_async(id_of, ()).await.unwrap(), 5);
        let before = r.to_here().await.unwrap().data.len();
        assert_eq!(r.rpc_async(push, (99,)).await.unwrap(), before + 1);
        // The owner registered the reference it was lent before answering; the answer itself
        // releases the caller's hold, with no acceptance message to wait for.
        assert_eq!(rref::debug_info(&a[0]).pending_children, 0);
        assert_eq!(*r.to_here().await.unwrap().data.last().unwrap(), 99);
        // local_value is for the owner only.
        match r.local_value().await {
            Err(RRefError::NotOwner { owner, worker, .. }) => {
                assert_eq!((owner.as_str(), worker.as_str()), ("worker2", "worker0"))
            }
            Err(e) => panic!("expected NotOwner, got {e:?}"),
            Ok(_) => panic!("expected NotOwner, got a value"),
        }
        // A method that makes a new remote value from two references: the pipeline of
        // `y = shard.remote(f, x); z = shard2.rpc_async(g, y)` without waiting in between.
        let x = rref::remote(&a[0], 1u32, make_slow, (ns, 3, 200)).unwrap();
        let y = r.remote(combine, (x.clone(), ns)).unwrap();
        let z = a[0].rpc_async(1u32, read_id, (y.clone(),)).await.unwrap();
        assert_eq!(z, 5003);
        drop((r, x, y));
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

#[test]
fn owner_local_references() {
    each_transport(60, |t| async move {
        let a = group(2, t, Duration::ZERO).await;
        let ns = ns();
        let r = RRef::new(&a[0], Tracked::new(ns, 11));
        assert!(r.is_owner() && r.confirmed_by_owner());
        assert_eq!(r.local_value().await.unwrap().lock().await.id, 11);
        assert_eq!(r.to_here().await.unwrap().id, 11);
        // Owner → user, then the user reads it back.
        assert_eq!(
            a[0].rpc_async(1u32, read_id, (r.clone(),)).await.unwrap(),
            11
        );
        // remote() to oneself.
        let s = rref::remote(&a[1], 1u32, make, (ns, 12)).unwrap();
        assert!(s.is_owner());
        assert_eq!(s.to_here().await.unwrap().id, 12);
        drop((r, s));
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

#[test]
fn sharing_in_every_direction_keeps_values_exactly_as_long_as_referenced() {
    for jitter in [Duration::ZERO, Duration::from_millis(5)] {
        each_transport(90, |t| async move {
            let a = group(3, t, jitter).await;
            let ns = ns();
            // Owned by worker1, created by worker0.
            let r = rref::remote(&a[0], 1u32, make, (ns, 21)).unwrap();
            // user→user before the owner confirmed anything: worker0 gives it to worker2.
            a[0].rpc_async(2u32, keep, (1, r.clone())).await.unwrap();
            // user→owner: worker0 gives it to its owner.
            assert!(
                a[0].rpc_async(1u32, keep, (2, r.clone())).await.unwrap(),
                "the owner's handle is confirmed"
            );
            drop(r);
            // The value lives on through the kept forks (its constructor may still be running
            // on a loaded machine: wait, bounded, for it to exist, then check it stays).
            let deadline = Instant::now() + Duration::from_secs(10);
            while live(ns) == 0 {
                assert!(Instant::now() < deadline, "the value was never constructed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(live(ns), 1);
            // A reference in a result: worker0 gets it back from worker2.
            let back = a[0]
                .rpc_async(2u32, give, (1,))
                .await
                .unwrap()
                .expect("kept");
            assert_eq!(back.to_here().await.unwrap().id, 21);
            // owner→user: worker1 (owner) hands its handle to worker2.
            let from_owner = a[0].rpc_async(1u32, give, (2,)).await.unwrap().unwrap();
            assert_eq!(
                a[0].rpc_async(2u32, read_id, (from_owner.clone(),))
                    .await
                    .unwrap(),
                21
            );
            // Nested in a struct, in both directions.
            let other = rref::remote(&a[0], 2u32, make, (ns, 4)).unwrap();
            let bundle = Bundle {
                label: "b".into(),
                refs: vec![back.clone(), other.clone()],
                extra: Some(Box::new(from_owner.clone())),
            };
            assert_eq!(
                a[0].rpc_async(1u32, bundle_sum, (bundle.clone(),))
                    .await
                    .unwrap(),
                21 + 4 + 21
            );
            assert_eq!(
                a[0].rpc_async(2u32, bundle_sum, (bundle,)).await.unwrap(),
                21 + 4 + 21
            );
            assert!(a[1].rpc_async(1u32, release, (2,)).await.unwrap());
            assert!(a[0].rpc_async(2u32, release, (1,)).await.unwrap());
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(live(ns), 2, "still referenced by worker0's handles");
            drop((back, from_owner, other));
            assert_quiescent(&a, ns).await;
            shutdown_all(&a).await;
        });
    }
}

/// Registered nowhere: calls to it are refused before their arguments are read.
#[rpc_core::remote]
async fn nowhere(_ctx: rpc_core::CallContext, r: RRef<Tracked>) -> Result<u64, rpc_core::BoxError> {
    Ok(r.to_here().await?.id)
}

/// A reference sent in a call the callee refuses unread (unknown function) is not held for a
/// registration that will never come: nothing is pending right after the error, and the value
/// goes as soon as the last real reference does.
#[test]
fn a_reference_in_a_refused_call_is_not_held() {
    each_transport(60, |t| async move {
        let a = group(3, t, Duration::ZERO).await;
        let ns = ns();
        let r = rref::remote(&a[0], 1u32, make, (ns, 8)).unwrap();
        assert_eq!(r.to_here().await.unwrap().id, 8);
        let err = a[0]
            .rpc_async(2u32, nowhere, (r.clone(),))
            .await
            .unwrap_err();
        assert!(
            matches!(err, rpc_core::RpcError::UnknownFunction { .. }),
            "{err:?}"
        );
        assert_eq!(
            rref::debug_info(&a[0]).pending_children,
            0,
            "the fork lent to the refused call is back"
        );
        drop(r);
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

/// A call that fails before its request is sent (here: nothing listens at the callee's
/// address any more) gives back the fork it lent at once.
#[test]
fn a_reference_in_a_call_that_was_never_sent_is_not_held() {
    each_transport(60, |t| async move {
        let a = group(3, t, Duration::ZERO).await;
        let ns = ns();
        let r = rref::remote(&a[0], 1u32, make, (ns, 12)).unwrap();
        assert_eq!(r.to_here().await.unwrap().id, 12);
        // Worker 2 leaves alone (its barrier gives up quickly); worker 0 never dialled it.
        a[2].shutdown_within(Duration::from_millis(200)).await;
        let err = a[0]
            .rpc_async(2u32, read_id, (r.clone(),))
            .await
            .unwrap_err();
        // Worker 2 told the group it was shutting down, so the error says that rather than
        // only that its address refuses connections.
        assert!(
            matches!(
                err,
                rpc_core::RpcError::PeerShutDown { .. } | rpc_core::RpcError::Unreachable { .. }
            ),
            "{err:?}"
        );
        assert_eq!(rref::debug_info(&a[0]).pending_children, 0);
        drop(r);
        assert_quiescent(&a[..2], ns).await;
        futures::future::join_all(
            a[..2]
                .iter()
                .map(|w| w.shutdown_within(Duration::from_secs(2))),
        )
        .await;
    });
}

/// Dropping a call that carries a reference cancels it on the callee, but only after the
/// callee has read its arguments: the reference is registered and released at once instead of
/// being held for an answer that never comes, and shutdown does not wait for it.
#[test]
fn a_cancelled_call_carrying_a_reference_is_cancelled_after_its_arguments_are_read() {
    static KEY: AtomicU64 = AtomicU64::new(1);
    each_transport(60, |t| async move {
        let a = group(3, t, Duration::ZERO).await;
        let ns = ns();
        let key = KEY.fetch_add(1, Ordering::Relaxed);
        let r = rref::remote(&a[0], 1u32, make, (ns, 9)).unwrap();
        assert_eq!(r.to_here().await.unwrap().id, 9);
        // Cancelled (dropped by the timeout) while the callee sleeps with the reference.
        let call = a[0].rpc_async(2u32, sleep_with, (key, r.clone(), 30_000));
        assert!(tokio::time::timeout(Duration::from_millis(300), call)
            .await
            .is_err());
        let deadline = Instant::now() + Duration::from_secs(10);
        while sleeper(key) != (true, true) || rref::debug_info(&a[0]).pending_children > 0 {
            assert!(
                Instant::now() < deadline,
                "sleeper {:?}, counters {:?}",
                sleeper(key),
                rref::debug_info(&a[0])
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(r);
        assert_quiescent(&a, ns).await;
        let t0 = Instant::now();
        shutdown_all(&a).await;
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    });
}

/// A call whose reply carries a reference, dropped after the callee has answered but before
/// the reply was read: the reply is still read, so the callee's hold on the fork it lent is
/// released at once (not after the ten-minute timeout for lost messages) and the value is
/// dropped once its last reference goes.
#[test]
fn a_dropped_call_whose_reply_carries_a_reference_releases_it() {
    static KEY: AtomicU64 = AtomicU64::new(2_000_000);
    each_transport(60, |t| async move {
        let a = group(3, t, Duration::ZERO).await;
        let ns = ns();
        let key = KEY.fetch_add(1, Ordering::Relaxed);
        // Worker 1 owns the value and keeps its own reference under `key`.
        let r = rref::remote(&a[0], 1u32, make, (ns, 11)).unwrap();
        assert!(a[0].rpc_async(1u32, keep, (key, r.clone())).await.is_ok());
        drop(r);
        // Ask for a copy of the reference, and give up after the answer was sent.
        let mut call = Box::pin(a[0].rpc_async(1u32, give, (key,)));
        assert!(futures::poll!(call.as_mut()).is_pending());
        let deadline = Instant::now() + Duration::from_secs(10);
        while rref::debug_info(&a[1]).pending_children == 0 {
            assert!(Instant::now() < deadline, "the answer was never sent");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(call);
        assert!(a[0].rpc_async(1u32, release, (key,)).await.unwrap());
        assert_quiescent(&a, ns).await;
        let t0 = Instant::now();
        shutdown_all(&a).await;
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    });
}

/// The same while the call still waits for an admission permit on the callee, before its
/// arguments were read (tarpc's own cancellation would drop it unread, and the reference would
/// be held for ten minutes): it is read, not run, and the reference is released.
#[test]
fn a_call_cancelled_before_it_starts_still_gives_back_its_reference() {
    static KEY: AtomicU64 = AtomicU64::new(1_000_000);
    each_transport(60, |t| async move {
        let a = start_group(
            3,
            t,
            Secret::generate(),
            |_| registry(),
            |rank, c| {
                let c = c.with_rpc_timeout(Duration::from_secs(20));
                if rank == 2 {
                    c.with_max_concurrent_calls(1)
                } else {
                    c
                }
            },
        )
        .await
        .unwrap();
        let ns = ns();
        let r = rref::remote(&a[0], 1u32, make, (ns, 10)).unwrap();
        assert_eq!(r.to_here().await.unwrap().id, 10);
        // Worker 2's only permit is taken for 1.5 s.
        let (blocker, queued) = (
            KEY.fetch_add(1, Ordering::Relaxed),
            KEY.fetch_add(1, Ordering::Relaxed),
        );
        let busy = tokio::spawn({
            let (a0, r) = (a[0].clone(), r.clone());
            async move { a0.rpc_async(2u32, sleep_with, (blocker, r, 1_500)).await }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sleeper(blocker).0 {
            assert!(Instant::now() < deadline, "the blocking call never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let call = a[0].rpc_async(2u32, sleep_with, (queued, r.clone(), 30_000));
        assert!(tokio::time::timeout(Duration::from_millis(300), call)
            .await
            .is_err());
        assert_eq!(busy.await.unwrap().unwrap(), 10);
        let deadline = Instant::now() + Duration::from_secs(10);
        while rref::debug_info(&a[0]).pending_children > 0 {
            assert!(
                Instant::now() < deadline,
                "counters {:?}",
                rref::debug_info(&a[0])
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            sleeper(queued),
            (false, false),
            "the cancelled call never ran"
        );
        drop(r);
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

#[test]
fn a_failed_constructor_is_reported_on_next_use() {
    each_transport(60, |t| async move {
        let a = group(2, t, Duration::ZERO).await;
        let r = rref::remote(&a[0], 1u32, make_fail, ("no GPU on this node".into(),)).unwrap();
        match r.to_here().await {
            Err(RRefError::CreationFailed { owner, message, .. }) => {
                assert_eq!(owner, "worker1");
                assert!(message.contains("no GPU on this node"), "{message}");
            }
            other => panic!("expected CreationFailed, got {other:?}"),
        }
        // Users who got the reference from the creator see the failure too.
        let err = a[0]
            .rpc_async(1u32, read_id, (r.clone(),))
            .await
            .unwrap_err();
        assert!(
            rpc_core::error_chain(&err).contains("no GPU on this node"),
            "{err}"
        );
        drop(r);
        assert_quiescent(&a, 0).await;
        shutdown_all(&a).await;
    });
}

#[test]
fn an_unreachable_owner_is_an_error_within_the_timeout() {
    each_transport(60, |t| async move {
        let a = start_group(
            2,
            t,
            Secret::generate(),
            |_| registry(),
            |_, c| {
                c.with_rpc_timeout(Duration::from_secs(2))
                    .with_shutdown_timeout(Duration::from_millis(300))
            },
        )
        .await
        .unwrap();
        let ns = ns();
        let r = rref::remote(&a[0], 1u32, make, (ns, 1)).unwrap();
        assert_eq!(r.to_here().await.unwrap().id, 1);
        let _ = a[1].shutdown().await;
        let start = Instant::now();
        let err = r.to_here().await.unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        let text = rpc_core::error_chain(&err);
        assert!(text.contains("worker1"), "{text}");
        drop(r);
        let _ = a[0].shutdown().await;
        rref::clear_owned(&a[1]);
    });
}

/// A seeded random program over four workers with message jitter: create, share in every
/// direction (args and results), read, call methods, drop; at the end nothing is left.
#[test]
fn random_programs_leave_nothing_behind() {
    each_transport(120, |t| async move {
        let a = group(4, t, Duration::from_millis(2)).await;
        let ns = ns();
        let mut seed = 0x5eed_u64 ^ ns;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut mine: Vec<(usize, RRef<Tracked>, u64)> = Vec::new();
        let mut kept_keys: Vec<(usize, u64)> = Vec::new();
        for step in 0..300u64 {
            match rnd(6) {
                0 | 1 => {
                    let (by, owner) = (rnd(4) as usize, rnd(4) as u32);
                    let r = rref::remote(&a[by], owner, make, (ns, step)).unwrap();
                    mine.push((by, r, step));
                }
                2 if !mine.is_empty() => {
                    let (by, r, id) = &mine[rnd(mine.len() as u64) as usize];
                    let to = rnd(4) as usize;
                    a[*by].rpc_async(to, keep, (step, r.clone())).await.unwrap();
                    kept_keys.push((to, step));
                    let _ = id;
                }
                3 if !mine.is_empty() => {
                    let (by, r, id) = &mine[rnd(mine.len() as u64) as usize];
                    let reader = rnd(4) as usize;
                    let got = a[*by]
                        .rpc_async(reader, read_id, (r.clone(),))
                        .await
                        .unwrap();
                    assert_eq!(got, *id);
                }
                4 if !mine.is_empty() => {
                    let i = rnd(mine.len() as u64) as usize;
                    drop(mine.swap_remove(i));
                }
                5 if !kept_keys.is_empty() => {
                    let (w, key) = kept_keys.swap_remove(rnd(kept_keys.len() as u64) as usize);
                    let from = rnd(4) as usize;
                    if let Some(r) = a[from].rpc_async(w, give, (key,)).await.unwrap() {
                        assert_eq!(
                            r.rpc_async(id_of, ()).await.unwrap(),
                            r.to_here().await.unwrap().id
                        );
                    }
                    assert!(a[from].rpc_async(w, release, (key,)).await.unwrap());
                }
                _ => {}
            }
        }
        drop(mine);
        for w in 0..4usize {
            a[0].rpc_async(w, release_all, ()).await.unwrap();
        }
        assert_quiescent(&a, ns).await;
        shutdown_all(&a).await;
    });
}

#[test]
fn references_cannot_be_serialized_outside_rpc() {
    run(30, async {
        let a = group(
            1,
            Transport::Memory(rpc_core::MemoryNetwork::new()),
            Duration::ZERO,
        )
        .await;
        let r = RRef::new(&a[0], 5u32);
        let err = serde_json_like(&r);
        assert!(err.contains("inside RPC"), "{err}");
        drop(r);
        shutdown_all(&a).await;
    });
}

fn serde_json_like(r: &RRef<u32>) -> String {
    serde_json::to_string(r).unwrap_err().to_string()
}

/// OWN-6: a peer names values the owner never made (forks of fabricated ids): past
/// `max_pending` its registrations are refused, naming the limit; once the entries are older
/// than `pending_ttl` they are given up, and the owner's table is back to what it holds.
#[test]
fn entries_for_values_that_never_come_are_bounded_and_given_up() {
    run(60, async {
        let a = group(
            2,
            Transport::Memory(rpc_core::MemoryNetwork::new()),
            Duration::ZERO,
        )
        .await;
        rref::set_limits(&a[0], rref::Limits::new(Duration::from_millis(300), 1000));
        let fabricated = |n: u64| rref::RRefId {
            created_on: 1,
            local: 1 << 40 | n,
        };
        let mut refused = None;
        for n in 0..1500 {
            if let Err(e) = rref::testing::register_fork(&a[1], 0, fabricated(n)).await {
                refused.get_or_insert(rpc_core::error_chain(&e));
            }
        }
        let refused = refused.expect("refused past the limit");
        assert!(refused.contains("limit max_pending = 1000"), "{refused}");
        assert_eq!(rref::debug_info(&a[0]).owner_values, 1000);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        // The next registration sweeps: what waited 300 ms is gone.
        rref::testing::register_fork(&a[1], 0, fabricated(5000))
            .await
            .unwrap();
        assert_eq!(rref::debug_info(&a[0]).owner_values, 1);
        for agent in &a {
            agent.shutdown_within(Duration::from_secs(2)).await;
        }
    });
}

//! In-process multi-worker tests of rpc-core. Each body runs over TCP and the in-memory
//! transport; every test is bounded by `run`'s timeout.

use std::time::{Duration, Instant};

use integration_tests::*;
use rpc_core::ext::AgentExt;
use rpc_core::testing::{self, start_group};
use rpc_core::{Agent, Blob, RemoteErrorKind, RpcError, Secret, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn group(n: u32, t: Transport) -> Vec<Agent> {
    start_group(n, t, Secret::generate(), |_| registry(), |_, c| c)
        .await
        .expect("group starts")
}

#[test]
fn calls_by_name_rank_and_worker_info() {
    each_transport(30, |t| async move {
        let a = group(3, t).await;
        assert_eq!(a[0].rpc_async("worker1", add, (2, 3)).await.unwrap(), 5);
        assert_eq!(a[1].rpc_async(2u32, add, (-1, 1)).await.unwrap(), 0);
        let info = a[0].get_worker_info("worker2").unwrap().clone();
        assert_eq!(info.id.0, 2);
        assert_eq!(
            a[0].rpc_async(&info, whoami, ()).await.unwrap(),
            ("worker0".into(), "worker2".into())
        );
        assert_eq!(a[2].get_worker_info(1u32).unwrap().name, "worker1");
        assert_eq!(a[2].worker_infos().len(), 3);
        shutdown_all(&a).await;
    });
}

/// A call's future stays small whatever the transport's state machine holds (that part is
/// boxed when first polled), so code that spawns many calls, as `rref::remote` does for each
/// new reference, copies a few hundred bytes per call instead of kilobytes.
/// A call's future keeps only the wait for its reply (and its arguments): the call is queued
/// when it is made, and anything else a call may need is boxed.
#[test]
fn call_futures_are_small() {
    each_transport(30, |t| async move {
        let a = group(2, t).await;
        let remote = a[0].rpc_async(1u32, add, (1, 2));
        let local = a[0].rpc_async(0u32, add, (1, 2));
        assert!(
            std::mem::size_of_val(&remote) <= 192,
            "{} bytes",
            std::mem::size_of_val(&remote)
        );
        assert!(std::mem::size_of_val(&local) <= 192);
        assert_eq!(remote.await.unwrap(), 3);
        assert_eq!(local.await.unwrap(), 3);
        // A keep call waits queued on its connection too (one per new remote reference,
        // thousands at once). No sink is registered here, so the callee refuses it, naming
        // the sink.
        let kept = a[0].rpc_keep(1u32, add, (1, 2), "no-such-sink", Vec::new());
        assert!(
            std::mem::size_of_val(&kept) <= 192,
            "{} bytes",
            std::mem::size_of_val(&kept)
        );
        match kept.await {
            Err(RpcError::UnknownFunction { worker, fn_name }) => {
                assert_eq!(worker, "worker1");
                assert!(fn_name.contains("no-such-sink"), "{fn_name}");
            }
            other => panic!("expected the sink to be unknown, got {other:?}"),
        }
        shutdown_all(&a).await;
    });
}

/// `rpc_async` to a connected peer starts when it is called, as PyTorch's does: the callee
/// runs it before the future is first polled (a later call on the same connection finds its
/// effect), and the future then yields its reply.
#[test]
fn rpc_async_starts_when_called() {
    each_transport(30, |t| async move {
        let a = group(2, t).await;
        // The connection is up once a call has gone through.
        assert_eq!(a[0].rpc_async(1u32, add, (0, 0)).await.unwrap(), 0);
        let started = a[0].rpc_async(1u32, hold, (Blob::from(vec![3u8; 10]),));
        let released = a[0].rpc_async(1u32, release_held, ()).await.unwrap();
        assert_eq!(released, vec![30], "the first call had not run");
        assert_eq!(started.await.unwrap(), 30);
        shutdown_all(&a).await;
    });
}

/// When the callee ran [`stamped`] last.
static STAMPED: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);

/// Notes when it ran.
#[rpc_core::remote]
async fn stamped(_ctx: rpc_core::CallContext) -> Result<(), rpc_core::BoxError> {
    *STAMPED.lock().unwrap() = Some(Instant::now());
    Ok(())
}

/// `rpc_async` from a task on a runtime thread (as an async `main`'s code is), then compute
/// off the runtime's threads (`rpc_core::spawn_blocking`): the callee runs the call while the
/// compute goes on. (Compute on the calling task itself would hold the runtime thread on
/// which tokio runs the connection's task next, and the request would leave only when the
/// task yields: `Agent::rpc_async`'s docs say so.)
#[test]
fn rpc_async_overlaps_compute_in_spawn_blocking() {
    each_transport(30, |t| async move {
        let a = start_group(
            2,
            t,
            Secret::generate(),
            |_| registry_builder().register(stamped).unwrap().build(),
            |_, c| c,
        )
        .await
        .unwrap();
        assert_eq!(a[0].rpc_async(1u32, add, (0, 0)).await.unwrap(), 0);
        let a0 = a[0].clone();
        let seen = tokio::spawn(async move {
            *STAMPED.lock().unwrap() = None;
            let t0 = Instant::now();
            let call = a0.rpc_async(1u32, stamped, ());
            rpc_core::spawn_blocking(|| std::thread::sleep(Duration::from_millis(400)))
                .await
                .unwrap();
            let seen = STAMPED.lock().unwrap().map(|s| s - t0);
            call.await.unwrap();
            seen
        })
        .await
        .unwrap();
        assert!(
            seen.is_some_and(|s| s < Duration::from_millis(200)),
            "the call ran {seen:?} after it was made, not during the compute"
        );
        shutdown_all(&a).await;
    });
}

/// A keep call to a connected peer is queued when it is made: the callee runs the function
/// and hands the result to its sink even if the caller drops the future without polling it
/// (`add` ends in its first poll on the callee, before the cancel that the drop sends behind
/// the request can arrive). Polled, the future resolves once the sink has taken the result.
#[test]
fn keep_calls_are_queued_when_made() {
    static KEPT: std::sync::Mutex<Vec<(Vec<u8>, i32)>> = std::sync::Mutex::new(Vec::new());
    let sink: rpc_core::ext::KeepSink = std::sync::Arc::new(|_ctx, token, value| {
        let v = value?;
        let n = *v.downcast_ref::<i32>().expect("an i32 was kept");
        KEPT.lock().unwrap().push((token, n));
        Ok(())
    });
    let kept = |token: &[u8], n: i32| {
        KEPT.lock()
            .unwrap()
            .iter()
            .any(|(t, v)| t == token && *v == n)
    };
    each_transport(30, |t| {
        let sink = sink.clone();
        async move {
            let name = rpc_core::testing::transport_name(&t).to_owned();
            let a = start_group(
                2,
                t,
                Secret::generate(),
                move |_| {
                    registry_builder()
                        .keep_sink("test-keep", sink.clone())
                        .unwrap()
                        .build()
                },
                |_, c| c,
            )
            .await
            .unwrap();
            // The connection is up once a call has gone through.
            assert_eq!(a[0].rpc_async(1u32, add, (0, 0)).await.unwrap(), 0);
            let dropped = format!("{name}-dropped").into_bytes();
            drop(a[0].rpc_keep(1u32, add, (20, 22), "test-keep", dropped.clone()));
            let by = Instant::now() + Duration::from_secs(10);
            while !kept(&dropped, 42) {
                assert!(
                    Instant::now() < by,
                    "the dropped keep call never reached its sink"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let awaited = format!("{name}-awaited").into_bytes();
            a[0].rpc_keep(1u32, add, (1, 2), "test-keep", awaited.clone())
                .await
                .unwrap();
            assert!(
                kept(&awaited, 3),
                "resolved before the sink took the result"
            );
            shutdown_all(&a).await;
        }
    });
}

/// With busy polling off (it is on by default), calls (plain, bulk, blocking) behave the
/// same and shutdown is clean.
#[test]
fn busy_polling_off_changes_nothing_but_speed() {
    each_transport(30, |t| async move {
        let a = start_group(
            3,
            t,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_busy_poll(Duration::ZERO),
        )
        .await
        .expect("group starts");
        for i in 0..200 {
            assert_eq!(
                a[i % 3]
                    .rpc_async((i as u32 + 1) % 3, add, (i as i32, 1))
                    .await
                    .unwrap(),
                i as i32 + 1
            );
        }
        // Blocking calls from a plain thread (on TCP, on the thread's own connection).
        let a0 = a[0].clone();
        let blocking = std::thread::spawn(move || {
            (0..50)
                .map(|i| a0.rpc_sync(1u32, add, (i, 1)).unwrap())
                .sum::<i32>()
        });
        let sum = tokio::task::spawn_blocking(move || blocking.join().unwrap())
            .await
            .unwrap();
        assert_eq!(sum, (1..=50).sum::<i32>());
        let big = Blob::from(vec![7u8; 1 << 20]);
        let back = a[0].rpc_async(1u32, echo, (big.clone(),)).await.unwrap();
        assert_eq!(&back[..], &big[..]);
        shutdown_all(&a).await;
    });
}

#[test]
fn blobs_nested_in_structs_round_trip_inline_and_bulk() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        let small = Blob::from(vec![1u8; 100]);
        let big = Blob::from(
            (0..3_000_000u32)
                .map(|i| (i % 251) as u8)
                .collect::<Vec<_>>(),
        );
        let p = Packet {
            label: "x".into(),
            parts: vec![small.clone(), big.clone(), Blob::default()],
        };
        let (back, total) = a[0].rpc_async(1u32, reverse_parts, (p,)).await.unwrap();
        assert_eq!(total, 3_000_100);
        assert_eq!(back.parts, vec![Blob::default(), big.clone(), small]);
        // Concurrent big echoes in both directions share the bulk connections correctly.
        let calls = (0..6).map(|i| {
            let data = Blob::from(vec![i as u8; 1 << 20 | i]);
            let from = &a[i % 3];
            async move {
                let out = from
                    .rpc_async((i + 1) % 3, echo, (data.clone(),))
                    .await
                    .unwrap();
                assert_eq!(out, data);
            }
        });
        futures::future::join_all(calls).await;
        shutdown_all(&a).await;
    });
}

/// Large blobs between workers on one host go through shared memory once the receiver has
/// mapped the sender's arena; a receiver that keeps blobs alive fills the arena, after which
/// blobs stream (nothing waits, nothing held is overwritten) until it lets them go; with the
/// arena off, everything streams.
#[test]
fn bulk_blobs_share_memory_on_one_host_and_stream_when_it_is_full() {
    let blob = |seed: u8| {
        Blob::from(
            (0..(1usize << 20) + 7)
                .map(|i| (i as u8).wrapping_mul(seed))
                .collect::<Vec<u8>>(),
        )
    };
    let sum = |b: &Blob| b.iter().map(|&x| u64::from(x)).sum::<u64>();
    if let Err(why) = testing::shared_memory_probe() {
        // Then the probe between workers fails too, and every blob must stream.
        eprintln!("no shared memory on this host ({why}): checking that blobs stream");
        each_transport(60, |t| async move {
            let a = group(2, t).await;
            for seed in [1u8, 3, 5] {
                let b = blob(seed);
                assert_eq!(a[0].rpc_async(1u32, echo, (b.clone(),)).await.unwrap(), b);
            }
            assert_eq!(a[0].bulk_stats().shared_blobs, 0);
            shutdown_all(&a).await;
        });
        return;
    }
    each_transport(60, |t| async move {
        // Room for two such blobs (each rounded up to whole pages) after the header page.
        let a = start_group(
            2,
            t.clone(),
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_shm_arena_bytes(4096 + (2 << 20) + (2 << 12)),
        )
        .await
        .unwrap();
        // The first blob announces the arena and streams; the peer's answer comes back
        // asynchronously, so echo until a blob has gone through shared memory.
        let mut rounds = 0;
        while a[0].bulk_stats().shared_blobs == 0 {
            rounds += 1;
            assert!(rounds < 200, "never shared: {:?}", a[0].bulk_stats());
            let b = blob(rounds as u8 | 1);
            assert_eq!(a[0].rpc_async(1u32, echo, (b.clone(),)).await.unwrap(), b);
        }
        assert!(
            a[0].bulk_stats().streamed_blobs >= 1,
            "the probe's blob streams"
        );
        // Replies go the same way, through the callee's own arena.
        assert!(a[1].bulk_stats().shared_blobs + a[1].bulk_stats().streamed_blobs >= 2);
        // A blob built for the peer sits in the arena already: sending it copies nothing, and it
        // stays intact on both sides for as long as either holds it.
        let staged = a[0]
            .blob_for(1u32, (1 << 20) + 7, |b| b.copy_from_slice(&blob(21)))
            .unwrap();
        assert_eq!(staged, blob(21));
        let before = a[0].bulk_stats();
        assert_eq!(
            a[0].rpc_async(1u32, hold, (staged.clone(),)).await.unwrap(),
            sum(&blob(21))
        );
        let after = a[0].bulk_stats();
        assert_eq!(
            (after.shared_blobs, after.streamed_blobs),
            (before.shared_blobs + 1, before.streamed_blobs)
        );
        assert_eq!(
            a[0].rpc_async(1u32, release_held, ()).await.unwrap(),
            vec![sum(&blob(21))]
        );
        assert_eq!(staged, blob(21), "the sender's copy is untouched");
        drop(staged);
        // Small blobs, and blobs for oneself, are ordinary ones.
        assert_eq!(
            a[0].blob_for(1u32, 10, |b| b.fill(1)).unwrap()[..],
            [1u8; 10]
        );
        assert_eq!(
            a[0].blob_for(0u32, 1 << 20, |b| b.fill(2)).unwrap().len(),
            1 << 20
        );
        assert!(a[0].blob_for(7u32, 10, |_| ()).is_err(), "no rank 7");
        // The callee keeps five blobs alive: at most two fit, the others stream.
        let before = a[0].bulk_stats();
        let mut sums = Vec::new();
        for seed in [5u8, 7, 9, 11, 13] {
            let b = blob(seed);
            sums.push(sum(&b));
            let got = a[0].rpc_async(1u32, hold, (b,)).await.unwrap();
            assert_eq!(got, sum(&blob(seed)));
        }
        let after = a[0].bulk_stats();
        let shared = after.shared_blobs - before.shared_blobs;
        let streamed = after.streamed_blobs - before.streamed_blobs;
        assert_eq!(shared + streamed, 5);
        assert!(shared <= 2 && streamed >= 3, "{before:?} -> {after:?}");
        // Nothing held was overwritten by the blobs that came after it.
        assert_eq!(a[0].rpc_async(1u32, release_held, ()).await.unwrap(), sums);
        // Released ranges are reused.
        let shared_before = a[0].bulk_stats().shared_blobs;
        let mut rounds = 0;
        while a[0].bulk_stats().shared_blobs == shared_before {
            rounds += 1;
            assert!(
                rounds < 200,
                "ranges never came back: {:?}",
                a[0].bulk_stats()
            );
            let b = blob(3);
            assert_eq!(a[0].rpc_async(1u32, echo, (b.clone(),)).await.unwrap(), b);
        }
        shutdown_all(&a).await;

        let a = start_group(
            2,
            t,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_shm_arena_bytes(0),
        )
        .await
        .unwrap();
        for seed in [1u8, 3, 5] {
            let b = blob(seed);
            assert_eq!(a[0].rpc_async(1u32, echo, (b.clone(),)).await.unwrap(), b);
        }
        for w in &a {
            let s = w.bulk_stats();
            assert_eq!((s.shared_blobs, s.streamed_blobs), (0, 3), "{s:?}");
            assert_eq!(s.streamed_bytes, 3 * ((1 << 20) + 7));
        }
        shutdown_all(&a).await;
    });
}

#[test]
fn self_calls_run_locally_without_serialization() {
    each_transport(30, |t| async move {
        let a = group(2, t).await;
        assert_eq!(
            a[0].rpc_async(0u32, double_local, (Unserializable(21),))
                .await
                .unwrap(),
            42
        );
        let err = a[0]
            .rpc_async(1u32, double_local, (Unserializable(21),))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                RpcError::Encode {
                    what: "arguments",
                    ..
                }
            ),
            "{err:?}"
        );
        // The local path applies the same error handling as the remote one.
        let err = a[1]
            .rpc_async("worker1", boom, ("local".into(),))
            .await
            .unwrap_err();
        assert_eq!(err.as_remote().unwrap().kind, RemoteErrorKind::Panic);
        shutdown_all(&a).await;
    });
}

#[test]
fn handler_errors_carry_worker_function_and_chain() {
    each_transport(30, |t| async move {
        let a = group(3, t).await;
        let err = a[0]
            .rpc_async(2u32, fail, ("ckpt-7".into(),))
            .await
            .unwrap_err();
        let r = err.as_remote().expect("remote error").clone();
        assert_eq!(r.kind, RemoteErrorKind::Handler);
        assert_eq!(r.worker, "worker2");
        assert_eq!(r.fn_name, "integration_tests::fail");
        assert_eq!(r.message, "could not save checkpoint ckpt-7");
        assert_eq!(r.chain, vec!["disk quota exceeded".to_string()]);
        let text = rpc_core::error_chain(&err);
        assert!(
            text.contains("worker2") && text.contains("disk quota"),
            "{text}"
        );
        let err = a[0].rpc_async(1u32, fail_anyhow, ()).await.unwrap_err();
        assert!(
            err.as_remote()
                .unwrap()
                .message
                .contains("parsing the step"),
            "{err}"
        );
        shutdown_all(&a).await;
    });
}

#[test]
fn panics_are_reported_and_the_worker_keeps_serving() {
    each_transport(30, |t| async move {
        let a = group(3, t).await;
        for _ in 0..3 {
            let err = a[0]
                .rpc_async(1u32, boom, ("kaboom".into(),))
                .await
                .unwrap_err();
            let r = err.as_remote().unwrap();
            assert_eq!(
                (r.kind, r.worker.as_str(), r.message.as_str()),
                (RemoteErrorKind::Panic, "worker1", "kaboom")
            );
            assert_eq!(a[0].rpc_async(1u32, add, (1, 1)).await.unwrap(), 2);
        }
        shutdown_all(&a).await;
    });
}

#[test]
fn unknown_function_and_type_mismatches_are_named() {
    each_transport(30, |t| async move {
        // worker1 serves nothing but `add_i64`; worker2 serves `add_as_string` under add's name.
        let a = start_group(
            3,
            t,
            Secret::generate(),
            |rank| match rank {
                1 => rpc_core::Registry::builder()
                    .register(add_i64)
                    .unwrap()
                    .build(),
                2 => rpc_core::Registry::builder()
                    .register(add_as_string)
                    .unwrap()
                    .build(),
                _ => registry(),
            },
            |_, c| c,
        )
        .await
        .unwrap();
        let err = a[0]
            .rpc_async(1u32, echo, (Blob::default(),))
            .await
            .unwrap_err();
        match &err {
            RpcError::UnknownFunction { worker, fn_name } => {
                assert_eq!(
                    (worker.as_str(), fn_name.as_str()),
                    ("worker1", "integration_tests::echo")
                )
            }
            e => panic!("expected UnknownFunction, got {e:?}"),
        }
        let err = a[0].rpc_async(1u32, add, (1, 2)).await.unwrap_err();
        match &err {
            RpcError::TypeMismatch { worker, detail, .. } => {
                assert_eq!(worker, "worker1");
                assert!(detail.contains("i64") && detail.contains("i32"), "{detail}");
            }
            e => panic!("expected TypeMismatch, got {e:?}"),
        }
        let err = a[0].rpc_async(2u32, add, (1, 2)).await.unwrap_err();
        assert!(
            matches!(&err, RpcError::TypeMismatch { detail, .. } if detail.contains("String")),
            "{err:?}"
        );
        // Locally too.
        let err = a[1].rpc_async(1u32, add, (1, 2)).await.unwrap_err();
        assert!(matches!(err, RpcError::TypeMismatch { .. }), "{err:?}");
        assert!(matches!(
            a[0].rpc_async(9u32, add, (1, 2)).await,
            Err(RpcError::UnknownWorker { .. })
        ));
        assert!(matches!(
            a[0].rpc_async("nobody", add, (1, 2)).await,
            Err(RpcError::UnknownWorker { .. })
        ));
        shutdown_all(&a).await;
    });
}

#[test]
fn timeouts_per_call_default_and_none() {
    each_transport(30, |t| async move {
        let a = start_group(
            2,
            t,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_rpc_timeout(Duration::from_millis(300)),
        )
        .await
        .unwrap();
        let start = Instant::now();
        let err = a[0].rpc_async(1u32, sleep_ms, (5_000,)).await.unwrap_err();
        assert!(
            matches!(&err, RpcError::DeadlineExceeded { worker, .. } if worker == "worker1"),
            "{err:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(3));
        let err = a[0]
            .rpc_async_timeout(1u32, sleep_ms, (5_000,), Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::DeadlineExceeded { .. }), "{err:?}");
        // Zero means no timeout: outlives the 300 ms default.
        assert_eq!(
            a[0].rpc_async_timeout(1u32, sleep_ms, (600,), Duration::ZERO)
                .await
                .unwrap(),
            600
        );
        // Local calls obey deadlines too.
        let err = a[0].rpc_async(0u32, sleep_ms, (5_000,)).await.unwrap_err();
        assert!(matches!(err, RpcError::DeadlineExceeded { .. }), "{err:?}");
        shutdown_all(&a).await;
    });
}

#[test]
fn nested_calls_inherit_the_deadline() {
    each_transport(30, |t| async move {
        let a = group(3, t).await;
        // The outer call has 2 s; the nested call's own default is 60 s but must see <= 2 s.
        let seen = a[0]
            .rpc_async_timeout(1u32, nested_remaining_ms, (2,), Duration::from_secs(2))
            .await
            .unwrap()
            .expect("nested call has a deadline");
        assert!(
            seen <= 2_000 && seen > 500,
            "nested call saw {seen} ms left"
        );
        let top = a[0]
            .rpc_async(1u32, remaining_ms, ())
            .await
            .unwrap()
            .unwrap();
        assert!(
            top > 50_000,
            "a plain call gets the 60 s default, saw {top} ms"
        );
        let none = a[0]
            .rpc_async_timeout(1u32, remaining_ms, (), Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(none, None);
        shutdown_all(&a).await;
    });
}

#[test]
fn nested_chain_of_200_levels_completes() {
    each_transport(120, |t| async move {
        let a = start_group(
            3,
            t,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_max_concurrent_calls(1),
        )
        .await
        .unwrap();
        // A→B→A→B… 200 hops, with a root-call limit of 1: nested calls must not need permits.
        assert_eq!(a[0].rpc_async(1u32, chain, (200, 0, 1)).await.unwrap(), 200);
        assert_eq!(a[2].rpc_async(0u32, chain, (200, 0, 1)).await.unwrap(), 200);
        shutdown_all(&a).await;
    });
}

#[test]
fn ten_thousand_concurrent_calls_complete() {
    each_transport(120, |t| async move {
        let a = group(3, t).await;
        let calls = (0..10_000i32)
            .map(|i| a[(i % 3) as usize].rpc_async(((i + 1) % 3) as u32, add, (i, 1)));
        let out = rpc_core::wait_all(calls).await.unwrap();
        assert_eq!(out.len(), 10_000);
        assert!(out.iter().enumerate().all(|(i, v)| *v == i as i32 + 1));
        // Concurrent sleepers overlap instead of queueing behind a pool.
        let start = Instant::now();
        let sleeps = (0..2_000).map(|_| a[0].rpc_async(1u32, sleep_ms, (200,)));
        rpc_core::wait_all(sleeps).await.unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        shutdown_all(&a).await;
    });
}

#[test]
fn dropping_the_future_cancels_the_call_on_the_callee() {
    let mut key = 1000;
    each_transport(30, |t| {
        key += 1;
        let key = key;
        async move {
            let a = group(2, t).await;
            let fut = a[0].rpc_async(1u32, hang, (key, 30));
            assert!(tokio::time::timeout(Duration::from_millis(200), fut)
                .await
                .is_err());
            let mut waited = 0;
            while !was_cancelled(key) && waited < 100 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                waited += 1;
            }
            assert!(was_cancelled(key), "callee handler was not cancelled");
            shutdown_all(&a).await;
        }
    });
}

#[test]
fn rpc_sync_works_from_plain_threads() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let agents = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), group(2, Transport::Tcp))
            .await
            .unwrap()
    });
    let a0 = agents[0].clone();
    let h = std::thread::spawn(move || a0.rpc_sync("worker1", add, (20, 22)));
    assert_eq!(h.join().unwrap().unwrap(), 42);
    // From inside the runtime it works through block_in_place.
    let a0 = agents[0].clone();
    let v = rt.block_on(async move {
        tokio::spawn(async move { a0.rpc_sync(1u32, add, (1, 2)) })
            .await
            .unwrap()
    });
    assert_eq!(v.unwrap(), 3);
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), shutdown_all(&agents))
            .await
            .unwrap()
    });
}

/// A multi-threaded runtime with `workers` threads, for tests that drive agents from plain
/// threads.
fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

fn block_on_for<F: std::future::Future>(
    rt: &tokio::runtime::Runtime,
    secs: u64,
    f: F,
) -> F::Output {
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(secs), f)
            .await
            .unwrap_or_else(|_| panic!("timed out after {secs} s"))
    })
}

/// How many threads of this process have this name (the callee's serving threads are named
/// `rpc-sync-<caller rank>`).
fn threads_named(name: &str) -> usize {
    threads_named_report(name).len()
}

/// The threads of this process that have this name, each as `tid state wchan` (what the
/// thread is blocked in), for assertion messages.
fn threads_named_report(name: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let path = e.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).ok()?;
        if comm.trim() != name {
            return None;
        }
        let stat = std::fs::read_to_string(path.join("stat")).unwrap_or_default();
        // The state follows the parenthesised name.
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        let wchan = std::fs::read_to_string(path.join("wchan")).unwrap_or_default();
        Some(format!(
            "{} {} {}",
            path.file_name()?.to_string_lossy(),
            state.unwrap_or("?"),
            wchan.trim()
        ))
    })
    .collect()
}

/// Everything `rpc_sync` does from a plain thread, with the thread's own connection and
/// without it: results, errors, bulk blobs both ways, a nested call back to the caller,
/// deadlines (after which the same thread's next call still works), self-calls.
#[test]
fn rpc_sync_from_plain_threads_behaves_the_same_on_both_paths() {
    for sync_connections in [true, false] {
        eprintln!("-- sync_connections {sync_connections}");
        let rt = runtime(2);
        let agents = block_on_for(&rt, 30, async {
            start_group(
                2,
                Transport::Tcp,
                Secret::generate(),
                |_| registry(),
                |_, c| {
                    c.with_sync_connections(sync_connections)
                        .with_bulk_threshold(64 << 10)
                },
            )
            .await
            .unwrap()
        });
        let a0 = agents[0].clone();
        std::thread::spawn(move || {
            assert_eq!(a0.rpc_sync(1u32, add, (20, 22)).unwrap(), 42);
            assert_eq!(a0.rpc_sync("worker0", add, (1, 1)).unwrap(), 2);
            let err = a0.rpc_sync(1u32, fail, ("ckpt-7".into(),)).unwrap_err();
            let text = rpc_core::error_chain(&err);
            assert!(
                text.contains("worker1") && text.contains("ckpt-7") && text.contains("quota"),
                "{text}"
            );
            let err = a0.rpc_sync(1u32, add_i64, (1, 2)).unwrap_err();
            assert!(matches!(err, RpcError::TypeMismatch { .. }), "{err:?}");
            // Large frames both ways without blobs (a 2 MiB label, sent back).
            let p = Packet {
                label: "y".repeat(2 << 20),
                parts: Vec::new(),
            };
            let (back, total) = a0.rpc_sync(1u32, reverse_parts, (p.clone(),)).unwrap();
            assert_eq!((back, total), (p, 0));
            assert_eq!(a0.rpc_sync(1u32, add, (1, 2)).unwrap(), 3);
            // Bulk blobs: a large argument and a large result.
            let big: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
            let back = a0.rpc_sync(1u32, echo, (Blob::from(big.clone()),)).unwrap();
            assert_eq!(&back[..], &big[..]);
            assert_eq!(a0.rpc_sync(1u32, zeros, (300_000,)).unwrap().len(), 300_000);
            // A handler that blocks: served on a sync connection's thread, its own blocking
            // call back into the caller takes that thread's connection.
            assert_eq!(a0.rpc_sync(1u32, add_blocking_on, (0, 2, 3)).unwrap(), 5);
            // The callee calls back into the caller while the caller's thread is blocked.
            let seen = a0
                .rpc_sync_timeout(1u32, nested_remaining_ms, (0,), Duration::from_secs(20))
                .unwrap()
                .expect("the nested call inherits a deadline");
            assert!(seen <= 20_000, "{seen}");
            let t = Instant::now();
            let err = a0
                .rpc_sync_timeout(1u32, sleep_ms, (5_000,), Duration::from_millis(200))
                .unwrap_err();
            assert!(
                matches!(&err, RpcError::DeadlineExceeded { worker, .. } if worker == "worker1"),
                "{err:?}"
            );
            assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
            // The late reply is never taken for the next call's.
            assert_eq!(a0.rpc_sync(1u32, sleep_ms, (1,)).unwrap(), 1);
            assert_eq!(a0.rpc_sync(1u32, add, (2, 3)).unwrap(), 5);
        })
        .join()
        .unwrap();
        // The same handler run on a runtime thread (an async caller): it blocks in place.
        let a0 = agents[0].clone();
        let v = block_on_for(&rt, 30, async move {
            a0.rpc_async(1u32, add_blocking_on, (0, 4, 5)).await
        });
        assert_eq!(v.unwrap(), 9);
        block_on_for(&rt, 60, shutdown_all(&agents));
    }
}

/// A blocking call on the thread's own connection needs none of the caller's runtime
/// threads: it completes while the only one is busy. (Through the runtime it could not
/// start until that thread is free.)
#[test]
fn rpc_sync_on_its_own_connection_needs_no_runtime_thread_of_the_caller() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let rt0 = runtime(1);
    let rt1 = runtime(2);
    let secret = Secret::generate();
    let server = block_on_for(
        &rt0,
        30,
        rpc_core::RendezvousServer::start(
            &Transport::Tcp,
            "127.0.0.1:0",
            secret.clone(),
            2,
            Duration::from_secs(30),
        ),
    )
    .unwrap();
    let config = |rank: u32| {
        rpc_core::Config::new()
            .with_rank(rank)
            .with_world_size(2)
            .with_init_method(format!("tcp://{}", server.local_addr()))
            .with_serve_rendezvous(false)
            .with_secret(secret.clone())
    };
    let a1 = rt1.spawn(rpc_core::init(config(1), registry()));
    let a0 = block_on_for(&rt0, 30, rpc_core::init(config(0), registry())).unwrap();
    let a1 = block_on_for(&rt1, 30, a1).unwrap().unwrap();
    block_on_for(&rt0, 10, server.finish(Duration::from_secs(5)));
    // Warm up: the thread's connection exists before the runtime is blocked.
    assert_eq!(a0.rpc_sync(1u32, add, (1, 1)).unwrap(), 2);
    let (started, finished) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (s, f) = (started.clone(), finished.clone());
    rt0.spawn(async move {
        s.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_secs(4));
        f.store(true, Ordering::SeqCst);
    });
    for _ in 0..400 {
        if started.load(Ordering::SeqCst) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        started.load(Ordering::SeqCst),
        "the blocking task never started"
    );
    assert_eq!(a0.rpc_sync(1u32, add, (40, 2)).unwrap(), 42);
    assert!(
        !finished.load(Ordering::SeqCst),
        "the call waited for the caller's runtime thread"
    );
    let (r0, r1) = (
        rt0.spawn({
            let a0 = a0.clone();
            async move { a0.shutdown().await }
        }),
        rt1.spawn({
            let a1 = a1.clone();
            async move { a1.shutdown().await }
        }),
    );
    assert!(block_on_for(&rt0, 60, r0).unwrap().is_clean());
    assert!(block_on_for(&rt1, 60, r1).unwrap().is_clean());
}

/// Threads' connections do not hold shutdown up, a call after shutdown is an error, and the
/// callee's serving threads end with their connections.
#[test]
fn sync_connections_close_with_their_thread_and_at_shutdown() {
    let rt = runtime(2);
    let agents = block_on_for(&rt, 30, group(4, Transport::Tcp));
    let serving = || threads_named("rpc-sync-3");
    // Threads end a moment after their connection closes: wait up to 30 s (a loaded 2-core
    // machine runs other tests beside this one) for none to be left, and say what any thread
    // left is blocked in.
    let serving_after_wait = || {
        for _ in 0..600 {
            if serving() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        threads_named_report("rpc-sync-3")
    };
    // A thread that ends: its connection closes, and the callee's thread ends with it.
    let a3 = agents[3].clone();
    std::thread::spawn(move || {
        for to in [0u32, 1] {
            assert_eq!(a3.rpc_sync(to, add, (1, 2)).unwrap(), 3);
        }
    })
    .join()
    .unwrap();
    let left = serving_after_wait();
    assert!(
        left.is_empty(),
        "serving threads outlived their connections: {left:?}"
    );
    // A thread that stays: its connection stays open until shutdown closes it.
    let a3 = agents[3].clone();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let caller = std::thread::spawn(move || {
        assert_eq!(a3.rpc_sync(2u32, add, (1, 2)).unwrap(), 3);
        done_tx.send(()).unwrap();
        go_rx.recv_timeout(Duration::from_secs(60)).unwrap();
        a3.rpc_sync(2u32, add, (1, 2))
    });
    done_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(serving(), 1);
    let reports = block_on_for(
        &rt,
        60,
        futures::future::join_all(agents.iter().map(|a| a.shutdown())),
    );
    for r in &reports {
        assert!(r.is_clean(), "{r:?}");
        // Not held up by the open connection (the group's shutdown timeout is 10 s).
        assert!(r.elapsed < Duration::from_secs(8), "{r:?}");
    }
    go_tx.send(()).unwrap();
    let err = caller.join().unwrap().unwrap_err();
    assert!(matches!(err, RpcError::Shutdown { .. }), "{err:?}");
    let left = serving_after_wait();
    assert!(
        left.is_empty(),
        "serving threads outlived shutdown: {left:?}"
    );
}

#[test]
fn rpc_sync_on_a_current_thread_runtime_is_an_error_not_a_hang() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), async {
            let a = group(2, Transport::Memory(rpc_core::MemoryNetwork::new())).await;
            let err = a[0].rpc_sync(1u32, add, (1, 2)).unwrap_err();
            assert!(matches!(err, RpcError::CannotBlock { .. }), "{err:?}");
            assert_eq!(a[0].rpc_async(1u32, add, (1, 2)).await.unwrap(), 3);
            shutdown_all(&a).await;
        })
        .await
        .unwrap()
    });
}

#[test]
fn shutdown_lets_calls_in_flight_finish_and_is_idempotent() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        let a0 = a[0].clone();
        let slow = tokio::spawn(async move { a0.rpc_async(1u32, sleep_ms, (700,)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (r1, r2, r0) = tokio::join!(a[1].shutdown(), a[2].shutdown(), async {
            // Worker 0 finishes its work (the slow call), then shuts down.
            let v = slow.await.unwrap();
            (v, a[0].shutdown().await)
        });
        assert_eq!(r0.0.unwrap(), 700, "the call in flight completed");
        assert!(
            r1.is_clean() && r2.is_clean() && r0.1.is_clean(),
            "{r1:?} {r2:?} {:?}",
            r0.1
        );
        // Idempotent: the same report again, immediately.
        let again = a[1].shutdown().await;
        assert_eq!(again.elapsed, r1.elapsed);
        // Use after shutdown is a clear error.
        let err = a[0].rpc_async(1u32, add, (1, 1)).await.unwrap_err();
        assert!(
            matches!(&err, RpcError::Shutdown { worker, .. } if worker == "worker0"),
            "{err:?}"
        );
        let err = a[0].rpc_async(0u32, add, (1, 1)).await.unwrap_err();
        assert!(matches!(err, RpcError::Shutdown { .. }), "{err:?}");
    });
}

#[test]
fn shutdown_does_not_hang_when_peers_vanish() {
    each_transport(60, |t| async move {
        let a = start_group(
            3,
            t,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_shutdown_timeout(Duration::from_millis(500)),
        )
        .await
        .unwrap();
        // Only worker 0 and 1 shut down; worker 2 never reaches the barrier.
        let start = Instant::now();
        let (r0, r1) = tokio::join!(a[0].shutdown(), a[1].shutdown());
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        let why = r0.barrier.unwrap_err();
        assert!(why.contains("[2]"), "rank 0 names the missing rank: {why}");
        assert!(r1.barrier.is_err());
        // Worker 2 now finds its peers gone and still returns.
        let r2 = a[2].shutdown().await;
        assert!(r2.barrier.is_err(), "{r2:?}");
        assert!(start.elapsed() < Duration::from_secs(10));
    });
}

#[test]
fn calls_to_a_shut_down_peer_fail_cleanly() {
    each_transport(60, |t| async move {
        let a = start_group(
            3,
            t,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_shutdown_timeout(Duration::from_millis(300)),
        )
        .await
        .unwrap();
        assert_eq!(a[0].rpc_async(1u32, add, (1, 1)).await.unwrap(), 2);
        let _ = a[1].shutdown().await;
        // It told the group it was shutting down: the calls that find it gone say so.
        for _ in 0..2 {
            let err = a[0].rpc_async(1u32, add, (1, 1)).await.unwrap_err();
            assert!(
                matches!(
                    &err,
                    RpcError::PeerShutDown { worker, .. }
                        | RpcError::PeerShuttingDown { worker, .. }
                        if worker == "worker1"
                ),
                "{err:?}"
            );
        }
        let _ = tokio::join!(a[0].shutdown(), a[2].shutdown());
    });
}

#[test]
fn wrong_secret_is_refused_and_the_worker_keeps_serving() {
    each_transport(30, |t| async move {
        let a = group(2, t.clone()).await;
        // A client with the wrong secret.
        let err = testing::dial_authenticated(&t, a[1].local_addr(), &Secret::new("wrong"), 0)
            .await
            .err()
            .expect("wrong secret refused");
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
        // A client that sends garbage instead of a handshake.
        let mut raw = testing::dial_raw(&t, a[1].local_addr()).await.unwrap();
        let mut hello = [0u8; 40];
        raw.read_exact(&mut hello).await.unwrap();
        // As long as a client's message (magic, kind, rank, incarnation, protection, nonce,
        // tag).
        raw.write_all(&[0xAB; 86]).await.unwrap();
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut rest))
            .await
            .unwrap();
        assert_eq!(rest, vec![0], "server answers 'rejected' and closes");
        assert_eq!(a[0].rpc_async(1u32, add, (2, 2)).await.unwrap(), 4);
        shutdown_all(&a).await;
    });
}

#[test]
fn a_worker_with_the_wrong_secret_cannot_join() {
    run(30, async {
        let secret = Secret::generate();
        let server = rpc_core::RendezvousServer::start(
            &Transport::Tcp,
            "127.0.0.1:0",
            secret,
            2,
            Duration::from_secs(2),
        )
        .await
        .unwrap();
        let cfg = rpc_core::Config::new()
            .with_rank(1)
            .with_world_size(2)
            .with_init_method(format!("tcp://{}", server.local_addr()))
            .with_serve_rendezvous(false)
            .with_secret(Secret::new("not the group's secret"));
        let err = rpc_core::init(cfg, registry()).await.unwrap_err();
        assert!(matches!(err, rpc_core::InitError::Auth { .. }), "{err:?}");
    });
}

#[test]
fn oversized_frames_are_refused_and_the_worker_keeps_serving() {
    each_transport(30, |t| async move {
        let secret = Secret::generate();
        let a = start_group(
            2,
            t.clone(),
            secret.clone(),
            |_| registry(),
            |_, c| c.with_max_frame_bytes(64 << 10),
        )
        .await
        .unwrap();
        // A peer that authenticates, then announces a 1 GiB frame.
        let conn = testing::dial_authenticated(&t, a[1].local_addr(), &secret, 0)
            .await
            .unwrap();
        assert_oversized_frame_closes(conn).await;
        // Our own oversized request is refused before it is sent.
        let err = a[0]
            .rpc_async(1u32, fail, ("x".repeat(100 << 10),))
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::TooLarge { .. }), "{err:?}");
        // Below the limit still works.
        let ok = a[0]
            .rpc_async(1u32, echo, (Blob::from(vec![0u8; 40 << 10]),))
            .await;
        assert_eq!(ok.unwrap().len(), 40 << 10);
        // A result over the limit is an error naming the callee, not a broken connection. (A
        // large blob result would take the bulk path; a large text rides in the frame.)
        let err = a[0]
            .rpc_async(1u32, big_text, (100 << 10,))
            .await
            .unwrap_err();
        let r = err.as_remote().expect("remote error");
        assert!(
            r.worker == "worker1" && r.message.contains("frame limit"),
            "{r}"
        );
        assert_eq!(a[0].rpc_async(1u32, add, (3, 4)).await.unwrap(), 7);
        shutdown_all(&a).await;
    });
}

/// Threads beyond `max_sync_connections` make their blocking calls through the runtime, so a
/// program with many calling threads costs its peers a bounded number of serving threads.
#[test]
fn sync_connections_are_capped_and_other_threads_go_through_the_runtime() {
    let rt = runtime(2);
    let agents = block_on_for(
        &rt,
        30,
        start_group(
            3,
            Transport::Tcp,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_max_sync_connections(1),
        ),
    )
    .unwrap();
    let serving = || threads_named("rpc-sync-2");
    // Thread A takes the only place and keeps its connection open.
    let a2 = agents[2].clone();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        assert_eq!(a2.rpc_sync(1u32, add, (1, 2)).unwrap(), 3);
        done_tx.send(()).unwrap();
        go_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    });
    done_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    // Thread B still gets its answers, through the runtime, to any peer.
    let a2 = agents[2].clone();
    std::thread::spawn(move || {
        for i in 0..20 {
            assert_eq!(a2.rpc_sync(1u32, add, (i, 1)).unwrap(), i + 1);
            assert_eq!(a2.rpc_sync(0u32, add, (i, 2)).unwrap(), i + 2);
        }
    })
    .join()
    .unwrap();
    assert_eq!(serving(), 1, "only the first thread has a connection");
    go_tx.send(()).unwrap();
    holder.join().unwrap();
    block_on_for(&rt, 60, shutdown_all(&agents));
}

/// Announces a 1 GiB frame on an authenticated connection; the worker must close it.
async fn assert_oversized_frame_closes(mut conn: Box<dyn testing::Io>) {
    conn.write_all(&(1u32 << 30).to_be_bytes()).await.unwrap();
    conn.flush().await.unwrap();
    // The worker may already have refused the header and closed the connection, so this
    // write may fail with a broken pipe; either way the read below must see the close.
    let _ = conn.write_all(&[0u8; 1024]).await;
    let _ = conn.flush().await;
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut sink)).await;
    assert!(closed.is_ok(), "the connection is closed, not left hanging");
}

/// The blocking path's own connections obey the frame limit at both ends too.
#[test]
fn oversized_frames_on_sync_connections_are_refused_and_the_worker_keeps_serving() {
    let rt = runtime(2);
    let secret = Secret::generate();
    let a = block_on_for(
        &rt,
        30,
        start_group(
            2,
            Transport::Tcp,
            secret.clone(),
            |_| registry(),
            |_, c| c.with_max_frame_bytes(64 << 10),
        ),
    )
    .unwrap();
    block_on_for(&rt, 30, async {
        let conn = testing::dial_authenticated_sync(&Transport::Tcp, a[1].local_addr(), &secret, 0)
            .await
            .unwrap();
        assert_oversized_frame_closes(conn).await;
    });
    let a0 = a[0].clone();
    std::thread::spawn(move || {
        let err = a0
            .rpc_sync(1u32, fail, ("x".repeat(100 << 10),))
            .unwrap_err();
        assert!(matches!(err, RpcError::TooLarge { .. }), "{err:?}");
        let err = a0.rpc_sync(1u32, big_text, (100 << 10,)).unwrap_err();
        let r = err.as_remote().expect("remote error");
        assert!(
            r.worker == "worker1" && r.message.contains("frame limit"),
            "{r}"
        );
        assert_eq!(a0.rpc_sync(1u32, add, (3, 4)).unwrap(), 7);
    })
    .join()
    .unwrap();
    block_on_for(&rt, 60, shutdown_all(&a));
}

#[test]
fn rendezvous_timeout_names_missing_ranks_and_refuses_duplicates() {
    each_transport(30, |t| async move {
        let secret = Secret::generate();
        let bind = match t {
            Transport::Tcp => "127.0.0.1:0",
            _ => "rdv:0",
        };
        let server = rpc_core::RendezvousServer::start(
            &t,
            bind,
            secret.clone(),
            3,
            Duration::from_millis(800),
        )
        .await
        .unwrap();
        let cfg = |rank: u32, name: &str| {
            rpc_core::Config::new()
                .with_name(name)
                .with_rank(rank)
                .with_world_size(3)
                .with_init_method(format!("tcp://{}", server.local_addr()))
                .with_serve_rendezvous(false)
                .with_transport(t.clone())
                .with_secret(secret.clone())
                .with_init_timeout(Duration::from_millis(800))
        };
        let (r0, r1, dup) = tokio::join!(
            rpc_core::init(cfg(0, "a"), registry()),
            rpc_core::init(cfg(1, "b"), registry()),
            async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                rpc_core::init(cfg(2, "a"), registry()).await
            }
        );
        for r in [r0, r1] {
            match r.unwrap_err() {
                rpc_core::InitError::RendezvousTimeout { missing, .. } => {
                    assert_eq!(missing, vec![2])
                }
                e => panic!("expected RendezvousTimeout, got {e:?}"),
            }
        }
        let e = dup.unwrap_err().to_string();
        assert!(e.contains("name `a` already taken"), "{e}");
    });
}

#[test]
fn rank_zero_hosts_the_rendezvous_by_default() {
    run(30, async {
        // Find a free port, then let rank 0 serve the rendezvous on it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let secret = Secret::generate();
        let agents = futures::future::try_join_all((0..3u32).map(|rank| {
            let cfg = rpc_core::Config::new()
                .with_rank(rank)
                .with_world_size(3)
                .with_init_method(format!("tcp://127.0.0.1:{port}"))
                .with_secret(secret.clone());
            rpc_core::init(cfg, registry())
        }))
        .await
        .unwrap();
        assert_eq!(agents[2].rpc_async(0u32, add, (1, 2)).await.unwrap(), 3);
        shutdown_all(&agents).await;
    });
}

#[test]
fn duplicate_and_reserved_registrations_are_errors() {
    let err = rpc_core::Registry::builder()
        .register(add)
        .unwrap()
        .register(add_i64)
        .err()
        .unwrap();
    assert!(err.to_string().contains("integration_tests::add"), "{err}");
    let r = rpc_core::Registry::builder().register(add).unwrap().build();
    assert!(r.contains(add));
    assert!(!r.contains(add_i64), "same name, different signature");
}

#[test]
fn call_metadata_follows_calls_nested_calls_and_self_calls() {
    each_transport(30, |t| async move {
        let a = group(3, t).await;
        let key = "test.ctx".to_string();
        let plain = a[0]
            .rpc_async(1u32, meta_seen, (key.clone(), Some(2)))
            .await
            .unwrap();
        assert_eq!(plain, (None, None));
        let with = rpc_core::ext::with_call_meta(&key, Some(b"ctx-7".to_vec()), async {
            let remote = a[0]
                .rpc_async(1u32, meta_seen, (key.clone(), Some(2)))
                .await
                .unwrap();
            let local = a[0]
                .rpc_async(0u32, meta_seen, (key.clone(), Some(0)))
                .await
                .unwrap();
            // A future created inside the scope keeps the metadata when awaited elsewhere.
            let fut = a[0].rpc_async(2u32, meta_seen, (key.clone(), None));
            (remote, local, fut)
        })
        .await;
        let expect = Some(b"ctx-7".to_vec());
        assert_eq!(with.0, (expect.clone(), expect.clone()));
        assert_eq!(with.1, (expect.clone(), expect.clone()));
        assert_eq!(with.2.await.unwrap().0, expect);
        shutdown_all(&a).await;
    });
}

#[test]
fn meta_providers_set_a_value_per_destination() {
    each_transport(30, |t| async move {
        let a = group(3, t).await;
        a[0].set_meta_provider(
            "test.hop",
            std::sync::Arc::new(|to: rpc_core::WorkerId| Some(vec![to.0 as u8])),
        );
        let key = "test.hop".to_string();
        // worker1 sees the value computed for it; its own call to worker2 carries its handler's
        // metadata (worker1 has no provider of its own).
        assert_eq!(
            a[0].rpc_async(1u32, meta_seen, (key.clone(), Some(2)))
                .await
                .unwrap(),
            (Some(vec![1]), Some(vec![1]))
        );
        assert_eq!(
            a[0].rpc_async(2u32, meta_seen, (key.clone(), None))
                .await
                .unwrap()
                .0,
            Some(vec![2])
        );
        // A provider overrides an inherited value, and `None` removes it.
        a[1].set_meta_provider("test.hop", std::sync::Arc::new(|_| None));
        assert_eq!(
            a[0].rpc_async(1u32, meta_seen, (key, Some(2)))
                .await
                .unwrap(),
            (Some(vec![1]), None)
        );
        shutdown_all(&a).await;
    });
}

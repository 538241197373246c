//! Membership that changes, in one process: a standalone rendezvous serves the group after it
//! formed; a worker that failed is replaced by a new incarnation under its name and rank
//! (every member hears of it and calls go to it, while the old incarnation is refused:
//! fencing); a worker leaves the running group gracefully and the others go on; a join for a
//! live rank is refused unless it says it replaces it; a value the failed incarnation owned
//! is reported gone; a group grows by ranks past its initial ones (also when they come while
//! it forms), and a dynamic group (no world size) has workers come, go and come back.
//! Multi-process replacement under the launcher is in `rpcrun`'s tests; a worker process
//! joining a running group of processes is in `multiprocess.rs`.

use std::time::Duration;

use integration_tests::elastic::ElasticGroup;
use integration_tests::rref_fns::make;
use integration_tests::*;
use rpc_core::testing;
use rpc_core::{
    Config, GroupSize, InitError, LeaveError, MembershipChange, MembershipEvent, MembershipWatch,
    RendezvousServer, RpcError, Secret, Transport,
};

const FAILURE_TIMEOUT: Duration = Duration::from_millis(600);

/// The test functions and the RRef test constructors.
fn registry() -> rpc_core::Registry {
    integration_tests::rref_fns::register(registry_builder()).build()
}

async fn group(transport: Transport) -> ElasticGroup {
    ElasticGroup::start(3, transport, registry, FAILURE_TIMEOUT).await
}

async fn next(w: &mut MembershipWatch) -> MembershipEvent {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("a membership change within 10 s")
        .expect("the watch goes on")
}

/// MEM-1, MEM-2, RDV-2, RDV-3: rank 2 freezes and is declared failed (every member hears the
/// same verdict, as generation 1); a restarted process joins in its place as incarnation 1
/// (generation 2 everywhere); calls to `worker2` reach it, the frozen incarnation's calls are
/// refused, and the group (new incarnation included) shuts down cleanly.
#[test]
fn a_failed_worker_is_replaced_and_its_old_incarnation_is_fenced() {
    each_transport(90, |t| async move {
        let g = group(t).await;
        let a = &g.agents;
        let mut watch0 = a[0].watch_membership();
        let mut watch1 = a[1].watch_membership();
        assert_eq!(a[0].rpc_async(2u32, incarnation_here, ()).await.unwrap(), 0);
        assert_eq!(a[2].rpc_async(0u32, add, (1, 2)).await.unwrap(), 3);
        let ns = 0xe1a5;
        let gone = rref::remote(&a[0], 2u32, make, (ns, 4)).unwrap();
        assert_eq!(gone.to_here().await.unwrap().id, 4);

        testing::silence(&a[2], true);
        for w in [&mut watch0, &mut watch1] {
            let e = next(w).await;
            assert_eq!((e.generation, e.rank, e.incarnation), (1, 2, 0), "{e:?}");
            assert!(
                matches!(&e.change, MembershipChange::Failed { .. }),
                "{e:?}"
            );
        }
        let err = a[0].rpc_async(2u32, add, (1, 1)).await.unwrap_err();
        assert!(matches!(err, RpcError::PeerFailed { .. }), "{err:?}");

        let new = g.start_rank(2, true).await.expect("the replacement joins");
        assert_eq!(new.incarnation(), 1);
        assert_eq!(new.name(), "worker2");
        for w in [&mut watch0, &mut watch1] {
            let e = next(w).await;
            assert_eq!((e.generation, e.rank, e.incarnation), (2, 2, 1), "{e:?}");
            assert!(
                matches!(&e.change, MembershipChange::Joined { addr } if addr == new.local_addr()),
                "{e:?}"
            );
        }
        // Every member has heard of the replacement now. A value the failed incarnation owned
        // is gone, and says so; values the new one makes are not confused with it (their ids
        // differ).
        let err = gone.to_here().await.unwrap_err();
        assert!(
            matches!(
                &err,
                rref::RRefError::OwnerReplaced { owner, incarnation: 0, now: 1, .. }
                    if owner == "worker2"
            ),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("replaced by incarnation 1"),
            "{err}"
        );
        let fresh = rref::remote(&a[0], 2u32, make, (ns, 5)).unwrap();
        assert_ne!(fresh.id(), gone.id());
        assert_eq!(fresh.to_here().await.unwrap().id, 5);
        drop((gone, fresh));
        for agent in &a[..2] {
            assert_eq!(agent.incarnation_of("worker2").unwrap(), 1);
            assert!(agent.is_live(2u32).unwrap());
            assert_eq!(
                agent.rpc_async(2u32, incarnation_here, ()).await.unwrap(),
                1,
                "calls go to the new incarnation"
            );
        }
        assert_eq!(new.rpc_async(0u32, add, (2, 3)).await.unwrap(), 5);
        assert_eq!(new.rpc_async(1u32, add, (2, 4)).await.unwrap(), 6);
        assert_eq!(
            new.generation(),
            2,
            "the replacement starts at the group's generation"
        );

        // The old incarnation thaws: the group refuses it.
        testing::silence(&a[2], false);
        let err = a[2]
            .rpc_async_timeout(0u32, add, (1, 1), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            !matches!(err, RpcError::Remote(_)),
            "the fenced incarnation was served: {err:?}"
        );
        let wire =
            testing::dial_as_incarnation(&g.transport, a[1].local_addr(), &g.secret, 2, 0).await;
        let refused = match wire {
            Err(_) => true,
            Ok(mut conn) => {
                use tokio::io::AsyncReadExt;
                let mut b = [0u8; 1];
                matches!(
                    tokio::time::timeout(Duration::from_secs(5), conn.read(&mut b)).await,
                    Ok(Ok(0)) | Ok(Err(_))
                )
            }
        };
        assert!(refused, "a connection of incarnation 0 was kept open");

        let reports = futures::future::join_all([&a[0], &a[1], &new].map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
        a[2].shutdown_within(Duration::from_secs(1)).await;
    });
}

/// A worker leaves the running group: every member hears of it, calls to it are refused with
/// `PeerLeft`, the others go on and shut down cleanly without it; rank 0 cannot leave.
#[test]
fn a_worker_leaves_gracefully_and_the_others_go_on() {
    each_transport(60, |t| async move {
        let g = group(t).await;
        let a = &g.agents;
        let mut watch = a[0].watch_membership();
        assert_eq!(a[0].rpc_async(2u32, add, (1, 1)).await.unwrap(), 2);
        let left = a[2].leave().await.expect("rank 2 leaves");
        assert!(left.is_clean(), "{left:?}");
        let e = next(&mut watch).await;
        assert_eq!((e.generation, e.rank), (1, 2), "{e:?}");
        assert_eq!(e.change, MembershipChange::Left);
        let err = a[0].rpc_async(2u32, add, (1, 1)).await.unwrap_err();
        assert!(
            matches!(&err, RpcError::PeerLeft { worker, .. } if worker == "worker2"),
            "{err:?}"
        );
        assert!(err.to_string().contains("left the group"), "{err}");
        assert!(!a[1].is_live("worker2").unwrap());
        assert_eq!(a[1].rpc_async(0u32, add, (2, 2)).await.unwrap(), 4);
        assert!(a[0].failed_workers().is_empty(), "leaving is no failure");
        assert!(matches!(
            a[0].leave().await,
            Err(LeaveError::RankZero { .. })
        ));
        let reports = futures::future::join_all(a[..2].iter().map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
        assert_eq!(a[2].shutdown().await.elapsed, left.elapsed);
    });
}

/// RDV-2: after the group formed, a join for a live rank is refused unless it replaces the
/// holder; RDV-5: a replacement without the holder's token waits for the holder to fail and
/// is refused when its deadline passes first; one with the token (its launcher's) takes the
/// rank at once, and the holder is declared failed everywhere.
#[test]
fn a_live_rank_is_taken_only_by_a_replacement() {
    run(60, async {
        let g = group(Transport::Tcp).await;
        let a = &g.agents;
        let err = g.start_rank(1, false).await.unwrap_err();
        assert!(
            matches!(&err, InitError::Refused(why) if why.contains("has not failed")),
            "{err:?}"
        );
        let brief = g
            .config(1)
            .with_replace(true)
            .with_init_timeout(Duration::from_secs(1));
        let err = rpc_core::init(brief, registry()).await.unwrap_err();
        assert!(
            matches!(&err, InitError::Refused(why) if why.contains("no token")),
            "{err:?}"
        );
        let token = rpc_core::testing::replace_token(&a[1]);
        let new = rpc_core::init(
            g.config(1).with_replace(true).with_replace_token(token),
            registry(),
        )
        .await
        .expect("a replacement takes the rank");
        assert_eq!(new.incarnation(), 1);
        let mut watch = a[0].watch_membership();
        let e = next(&mut watch).await;
        assert_eq!((e.rank, e.incarnation), (1, 0));
        assert!(
            matches!(&e.change, MembershipChange::Failed { cause } if cause.contains("replaced")),
            "{e:?}"
        );
        let e = next(&mut watch).await;
        assert_eq!((e.rank, e.incarnation), (1, 1));
        assert_eq!(a[0].rpc_async(1u32, incarnation_here, ()).await.unwrap(), 1);
        assert_eq!(a[2].rpc_async(1u32, incarnation_here, ()).await.unwrap(), 1);
        let reports = futures::future::join_all([&a[0], &new, &a[2]].map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
        a[1].shutdown_within(Duration::from_secs(1)).await;
    });
}

/// RDV-2 for a group that grows: a group of 2 growing to 4 runs with ranks 2 and 3 vacant
/// (calls to them are refused, naming the vacancy); rank 3 joins the running group (every
/// member hears of it, calls go both ways, it lists the others and they list it); a second
/// worker cannot take its name, nor a rank past the capacity; it leaves, and the group shuts
/// down cleanly with a rank that never came.
#[test]
fn a_group_that_grows_admits_new_ranks_while_it_runs() {
    each_transport(90, |t| async move {
        let g =
            ElasticGroup::start_sized(GroupSize::growing(2, 4), t, registry, FAILURE_TIMEOUT).await;
        let a = &g.agents;
        assert_eq!(a[0].world_size(), 4);
        assert_eq!(a[0].worker_infos().len(), 2);
        let err = a[0].rpc_async(3u32, add, (1, 1)).await.unwrap_err();
        assert!(
            matches!(&err, RpcError::UnknownWorker { .. }) && err.to_string().contains("vacant"),
            "{err}"
        );
        assert!(a[1].get_worker_info("worker3").is_err());
        let mut watch0 = a[0].watch_membership();
        let mut watch1 = a[1].watch_membership();
        let new = g.start_rank(3, false).await.expect("a new rank joins");
        assert_eq!((new.incarnation(), new.world_size()), (0, 4));
        for w in [&mut watch0, &mut watch1] {
            let e = next(w).await;
            assert_eq!(
                (e.generation, e.rank, e.incarnation, e.name.as_str()),
                (1, 3, 0, "worker3"),
                "{e:?}"
            );
            assert!(matches!(e.change, MembershipChange::Joined { .. }), "{e:?}");
        }
        assert_eq!(a[0].rpc_async("worker3", add, (2, 3)).await.unwrap(), 5);
        assert_eq!(a[1].rpc_async(3u32, add, (2, 4)).await.unwrap(), 6);
        assert_eq!(new.rpc_async(1u32, add, (4, 3)).await.unwrap(), 7);
        for x in [&a[0], &a[1], &new] {
            let names: Vec<String> = x.worker_infos().into_iter().map(|w| w.name).collect();
            assert_eq!(names, ["worker0", "worker1", "worker3"]);
        }
        let err = rpc_core::init(g.config(2).with_name("worker3"), registry())
            .await
            .unwrap_err();
        assert!(
            matches!(
                &err,
                InitError::Refused(why) if why.contains("`worker3` already taken by rank 3")
            ),
            "{err:?}"
        );
        let err = g.start_rank(4, false).await.unwrap_err();
        assert!(
            err.to_string()
                .contains("rank 4 is outside a group of 2 growing to 4"),
            "{err}"
        );
        let left = new.leave().await.expect("rank 3 leaves");
        assert!(left.is_clean(), "{left:?}");
        let e = next(&mut watch0).await;
        assert_eq!((e.rank, e.change), (3, MembershipChange::Left));
        let reports = futures::future::join_all(a.iter().map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
    });
}

/// RDV-1/RDV-2: a worker with a rank past the initial ones that starts while the group is
/// still forming waits, and joins as soon as it has formed.
#[test]
fn a_new_rank_that_comes_while_the_group_forms_joins_once_it_formed() {
    run(60, async {
        let secret = Secret::generate();
        let size = GroupSize::growing(2, 3);
        let server = RendezvousServer::start(
            &Transport::Tcp,
            "127.0.0.1:0",
            secret.clone(),
            size,
            Duration::from_secs(30),
        )
        .await
        .expect("rendezvous starts");
        let config = |rank: u32| {
            Config::new()
                .with_rank(rank)
                .with_world_size(2)
                .with_max_world_size(3)
                .with_init_method(format!("tcp://{}", server.local_addr()))
                .with_serve_rendezvous(false)
                .with_secret(secret.clone())
                .with_shutdown_timeout(Duration::from_secs(5))
        };
        // Rank 2 starts first.
        let early = tokio::spawn(rpc_core::init(config(2), registry()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!early.is_finished(), "rank 2 waits for the group to form");
        let formed =
            futures::future::try_join_all((0..2).map(|r| rpc_core::init(config(r), registry())))
                .await
                .expect("the group forms");
        let late = early.await.unwrap().expect("rank 2 joins once it formed");
        assert_eq!(late.worker_infos().len(), 3);
        assert_eq!(late.rpc_async(0u32, add, (1, 1)).await.unwrap(), 2);
        assert_eq!(formed[1].rpc_async(2u32, add, (2, 1)).await.unwrap(), 3);
        let all = [&formed[0], &formed[1], &late];
        let reports = futures::future::join_all(all.map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
    });
}

/// PyTorch's dynamic mode: no world size. The first worker (rank 1 here) forms the group
/// alone; rank 0 joins, then rank 2 after rank 1 left; rank 1 comes back as its next
/// incarnation; calls follow the members, and the group shuts down cleanly.
#[test]
fn a_dynamic_group_has_no_world_size_and_workers_come_and_go() {
    each_transport(90, |t| async move {
        let g =
            ElasticGroup::start_sized(GroupSize::dynamic(3), t, registry, FAILURE_TIMEOUT).await;
        assert!(g.agents.is_empty());
        let w1 = g
            .start_rank(1, false)
            .await
            .expect("the first worker is the group");
        assert_eq!(w1.worker_infos().len(), 1);
        let mut watch1 = w1.watch_membership();
        let w0 = g.start_rank(0, false).await.expect("rank 0 joins");
        let e = next(&mut watch1).await;
        assert_eq!((e.rank, e.incarnation), (0, 0), "{e:?}");
        assert_eq!(w0.rpc_async(1u32, add, (1, 2)).await.unwrap(), 3);
        assert_eq!(w1.rpc_async(0u32, add, (2, 2)).await.unwrap(), 4);
        let mut watch0 = w0.watch_membership();
        let left = w1.leave().await.expect("rank 1 leaves");
        assert!(left.is_clean(), "{left:?}");
        let e = next(&mut watch0).await;
        assert_eq!((e.rank, e.change), (1, MembershipChange::Left));
        let w2 = g.start_rank(2, false).await.expect("rank 2 joins");
        assert_eq!(w2.rpc_async(0u32, add, (3, 3)).await.unwrap(), 6);
        let err = w2.rpc_async(1u32, add, (1, 1)).await.unwrap_err();
        assert!(matches!(&err, RpcError::PeerLeft { .. }), "{err:?}");
        let e = next(&mut watch0).await;
        assert_eq!((e.rank, e.incarnation), (2, 0), "{e:?}");
        let back = g.start_rank(1, false).await.expect("rank 1 comes back");
        assert_eq!(back.incarnation(), 1);
        let e = next(&mut watch0).await;
        assert_eq!((e.rank, e.incarnation), (1, 1), "{e:?}");
        assert_eq!(w0.rpc_async(1u32, incarnation_here, ()).await.unwrap(), 1);
        assert_eq!(back.rpc_async(2u32, add, (5, 5)).await.unwrap(), 10);
        let reports = futures::future::join_all([&w0, &w2, &back].map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
        w1.shutdown_within(Duration::from_secs(1)).await;
    });
}

/// Waits up to 10 s for `agent`'s link to the rendezvous to be back. (Not an instant check:
/// a resumed member applies the group's table before it counts its link as back, so another
/// task can see the change first; and a re-dial backs off.)
async fn link_back(agent: &rpc_core::Agent) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !testing::has_rendezvous_link(agent) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}'s rendezvous link not back within 10 s",
            agent.name()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// RDV-6: a member whose link to the rendezvous broke dials it again and resumes as the same
/// incarnation, so it still hears of the group's changes: rank 2, replaced right after rank
/// 1's link was cut, is reached by rank 1 at its new incarnation. Without the resume, rank 1
/// heard of no replacement again and went on calling the old process's address.
#[test]
fn a_member_that_lost_its_rendezvous_link_resumes_and_misses_no_change() {
    each_transport(60, |t| async move {
        let g = group(t).await;
        let a = &g.agents;
        // Handled within microseconds; the replacement below takes milliseconds to join.
        testing::cut_rendezvous_link(&a[1]);
        let token = testing::replace_token(&a[2]);
        let new = rpc_core::init(
            g.config(2).with_replace(true).with_replace_token(token),
            registry(),
        )
        .await
        .expect("the replacement joins");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while a[1].incarnation_of(2u32).unwrap() != 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "rank 1 never heard of rank 2's replacement"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        link_back(&a[1]).await;
        assert_eq!(a[1].rpc_async(2u32, incarnation_here, ()).await.unwrap(), 1);
        // Cut again: the resumed link is as good as the first.
        testing::cut_rendezvous_link(&a[1]);
        tokio::time::sleep(Duration::from_millis(200)).await;
        link_back(&a[1]).await;
        let reports = futures::future::join_all([&a[0], &a[1], &new].map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
        a[2].shutdown_within(Duration::from_secs(1)).await;
    });
}

/// RDV-7: a rendezvous that falls silent (a frozen process keeps its connections open and says
/// nothing) is noticed: the members take their links for broken within the link's silence
/// bound (3 s) and are adrift (which their launchers end, SUP-3); once it speaks again they
/// resume. Before RDV-7 a member waited on a frozen rendezvous for good, never adrift.
#[test]
fn a_frozen_rendezvous_leaves_its_members_adrift_within_the_silence_bound() {
    run(60, async {
        let g = group(Transport::Tcp).await;
        let a = &g.agents;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(a.iter().all(testing::has_rendezvous_link));
        testing::freeze_rendezvous(&g.server, true);
        let frozen = tokio::time::Instant::now();
        while a.iter().any(testing::has_rendezvous_link) {
            assert!(
                frozen.elapsed() < Duration::from_secs(6),
                "a member still counts on a rendezvous silent for 6 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = frozen.elapsed();
        assert!(
            took >= Duration::from_millis(2500),
            "adrift after only {took:?}"
        );
        testing::freeze_rendezvous(&g.server, false);
        let thawed = tokio::time::Instant::now();
        while !a.iter().all(testing::has_rendezvous_link) {
            assert!(
                thawed.elapsed() < Duration::from_secs(10),
                "the members did not resume once the rendezvous spoke again"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for r in futures::future::join_all(a.iter().map(|x| x.shutdown())).await {
            assert!(r.is_clean(), "{r:?}");
        }
    });
}

/// VIEW-1: right after a replacement joined, each member hears of it in its own time; a
/// coordinator that waits with `await_known` finds every worker it asked knowing the new
/// incarnation, and is told which did not when it asks about one nobody has. (The hybrid
/// example's master once asked a worker for a collective with a replacement that worker had not
/// heard of yet: the collective failed naming the old incarnation, in `three_hosts.rs`.)
#[test]
fn a_coordinator_waits_until_the_others_know_a_replacement() {
    each_transport(60, |t| async move {
        let g = group(t).await;
        let a = &g.agents;
        let token = testing::replace_token(&a[2]);
        let new = rpc_core::init(
            g.config(2).with_replace(true).with_replace_token(token),
            registry(),
        )
        .await
        .expect("the replacement joins");
        let late = a[0]
            .await_known([0, 1], 2, 1, Duration::from_secs(10))
            .await
            .unwrap();
        assert!(late.is_empty(), "{late:?}");
        for w in [&a[0], &a[1]] {
            assert_eq!(w.incarnation_of(2u32).unwrap(), 1);
            assert!(w.is_live(2u32).unwrap());
        }
        let late = a[0]
            .await_known([1], 2, 7, Duration::from_millis(200))
            .await
            .unwrap();
        assert_eq!(late, [1]);
        let reports = futures::future::join_all([&a[0], &a[1], &new].map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
        a[2].shutdown_within(Duration::from_secs(1)).await;
    });
}

/// RDV-9: a failure report lost on its way to the rendezvous (its connection broke with the
/// report in flight) is sent again once the member is linked again, for as long as the group
/// has not decided on that incarnation: rank 2 stops its heartbeats while the rendezvous drops
/// every report it reads (`testing::deafen_rendezvous`); once it hears again and the two
/// reporters' links break and come back, the group declares rank 2 failed. Before, a member's
/// detector reported once (LIVE-1) and the report was gone with the link: rank 2 stayed a
/// member for good though both others refused it.
#[test]
fn a_report_lost_with_its_link_is_sent_again() {
    run(60, async {
        let g = group(Transport::Tcp).await;
        let a = &g.agents;
        let mut events = g.server.subscribe();
        testing::deafen_rendezvous(&g.server, true);
        testing::silence(&a[2], true);
        // Both detectors decide within the failure timeout and report to a deaf rendezvous.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while a[0].is_live(2u32).unwrap() || a[1].is_live(2u32).unwrap() {
            assert!(tokio::time::Instant::now() < deadline, "no local verdicts");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        testing::deafen_rendezvous(&g.server, false);
        testing::cut_rendezvous_link(&a[0]);
        testing::cut_rendezvous_link(&a[1]);
        let failed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match events.recv().await {
                    Ok(e) if e.rank == 2 && matches!(e.change, MembershipChange::Failed { .. }) => {
                        return e;
                    }
                    Ok(_) => {}
                    Err(e) => panic!("the rendezvous's events ended: {e}"),
                }
            }
        })
        .await
        .expect("the group declares rank 2 failed within 10 s of the links' return");
        assert_eq!(failed.incarnation, 0, "{failed:?}");
        testing::silence(&a[2], false);
        for x in a {
            let _ = x.shutdown().await;
        }
    });
}

/// RDV-10: once its host says the job ended, the rendezvous tells every connection so: a
/// probe (a launcher asking before it restarts a process) and a join both get
/// `InitError::JobEnded`, never a seat in a group that is gone, and a member still linked
/// loses its link; before the end, the probe answers plainly and the member is linked.
#[test]
fn after_the_job_ended_the_rendezvous_says_so_to_probes_and_joins() {
    run(60, async {
        let secret = Secret::generate();
        let server = RendezvousServer::start(
            &Transport::Tcp,
            "127.0.0.1:0",
            secret.clone(),
            1,
            Duration::from_secs(30),
        )
        .await
        .expect("rendezvous starts");
        let addr = server.local_addr().to_owned();
        let probe =
            || rpc_core::probe_rendezvous(&Transport::Tcp, &addr, &secret, Duration::from_secs(5));
        probe().await.expect("a live rendezvous answers");
        let config = || {
            Config::new()
                .with_rank(0)
                .with_world_size(1)
                .with_init_method(format!("tcp://{addr}"))
                .with_serve_rendezvous(false)
                .with_secret(secret.clone())
                .with_shutdown_timeout(Duration::from_secs(5))
        };
        let member = rpc_core::init(config(), registry()).await.expect("joins");
        let linked = |want: Vec<u32>| {
            let server = &server;
            async move {
                for _ in 0..300 {
                    if server.linked_ranks() == want {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                panic!("linked {:?}, not {want:?}", server.linked_ranks());
            }
        };
        linked(vec![0]).await;
        server.end();
        let e = probe().await.expect_err("the job ended");
        assert!(matches!(e, rpc_core::InitError::JobEnded { .. }), "{e:?}");
        linked(vec![]).await;
        let e = rpc_core::init(config(), registry())
            .await
            .expect_err("nothing is left to join");
        assert!(rpc_core::error_chain(&e).contains("has ended"), "{e:?}");
        drop(member);
    });
}

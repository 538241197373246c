//! Ending a group: workers that only serve wait for the whole group (`Agent::wait_for_group`),
//! however long the master works; a worker that shut down on its own is named as such by the
//! calls that find it gone; failed workers are named in the shutdown report.

use std::time::Duration;

use integration_tests::*;
use rpc_core::testing::start_group;
use rpc_core::{Agent, RpcError, Secret, Transport};

/// A group of three whose shutdown timeout is 1 s.
async fn group(t: Transport) -> Vec<Agent> {
    group_with(t, Duration::from_secs(1)).await
}

/// A group of three whose shutdown timeout is `timeout`.
async fn group_with(t: Transport, timeout: Duration) -> Vec<Agent> {
    start_group(
        3,
        t,
        Secret::generate(),
        |_| registry(),
        move |_, c| c.with_shutdown_timeout(timeout),
    )
    .await
    .expect("group starts")
}

/// Each of `workers` waiting for the group (`Agent::wait_for_group`) in a task of its own.
fn wait_for_group(workers: &[Agent]) -> Vec<tokio::task::JoinHandle<rpc_core::ShutdownReport>> {
    workers
        .iter()
        .map(|w| {
            let w = w.clone();
            tokio::spawn(async move { w.wait_for_group().await })
        })
        .collect()
}

/// The workers call `wait_for_group` as soon as they have joined; the master works for 3 s
/// (three times the shutdown timeout) and calls them throughout, then shuts down: every
/// call is served and the three end cleanly together.
#[test]
fn workers_that_wait_for_the_group_serve_a_master_that_works_long() {
    each_transport(60, |t| async move {
        let a = group(t).await;
        let waiting = wait_for_group(&a[1..]);
        for i in 0..6 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            for r in 1..3u32 {
                assert_eq!(a[0].rpc_async(r, add, (i, 1)).await.unwrap(), i + 1);
            }
        }
        let master = a[0].shutdown().await;
        assert!(master.is_clean(), "{master:?}");
        for w in waiting {
            let r = w.await.unwrap();
            assert!(r.is_clean(), "{r:?}");
        }
    });
}

/// A worker that shuts down by itself (its 1 s barrier gives up while the master still
/// works): the master's later call says that worker shut down, not only that its address
/// refuses connections.
#[test]
fn a_call_to_a_worker_that_shut_down_says_so() {
    run(60, async {
        let a = group(Transport::Tcp).await;
        let gone = a[1].shutdown().await;
        assert!(gone.barrier.is_err(), "the others never came: {gone:?}");
        let e = a[0].rpc_async(1u32, add, (1, 1)).await.unwrap_err();
        assert!(matches!(e, RpcError::PeerShutDown { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("worker `worker1` has shut down"), "{msg}");
        for r in futures::future::join_all(
            [&a[0], &a[2]].map(|a| a.shutdown_within(Duration::from_secs(2))),
        )
        .await
        {
            assert_eq!(r.aborted, 0, "{r:?}");
        }
    });
}

/// A worker declared failed is named in the survivors' shutdown reports.
#[test]
fn the_shutdown_report_names_the_workers_that_failed() {
    run(60, async {
        let a = group(Transport::Memory(rpc_core::MemoryNetwork::new())).await;
        rpc_core::testing::silence(&a[2], true);
        let by = std::time::Instant::now() + Duration::from_secs(10);
        while a[0].is_live(2u32).unwrap() || a[1].is_live(2u32).unwrap() {
            assert!(std::time::Instant::now() < by, "worker 2 declared failed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let reports = futures::future::join_all([&a[0], &a[1]].map(|a| a.shutdown())).await;
        for r in reports {
            assert_eq!(r.failed.len(), 1, "{r:?}");
            assert_eq!(r.failed[0].name, "worker2");
            assert!(r.barrier.unwrap_err().contains("[2]"));
        }
        a[2].shutdown_within(Duration::from_secs(1)).await;
    });
}

/// SHUT-1: a master whose job failed says so at the barrier; the workers that only served
/// hear it, so their reports are not clean and they cannot exit 0 for a failed job. Before,
/// their reports were clean and a launcher of those workers alone reported success.
#[test]
fn a_failed_job_is_no_success_on_any_member() {
    each_transport(60, |t| async move {
        let a = group(t).await;
        let waiting = wait_for_group(&a[1..]);
        let master = a[0].shutdown_failed("step 7: the loss is NaN", false).await;
        assert!(!master.is_clean(), "{master:?}");
        for w in waiting {
            let r = w.await.unwrap();
            assert!(!r.is_clean(), "{r:?}");
            let f = r.job_failed.clone().expect("told of the failure");
            assert_eq!((f.rank, f.worker.as_str()), (0, a[0].name()));
            assert_eq!(
                (f.cause.as_str(), f.retry),
                ("step 7: the loss is NaN", false)
            );
            assert!(r.barrier.is_ok(), "the barrier itself completed: {r:?}");
        }
        // A second shutdown returns the first one's report (AG-4).
        assert!(a[0].shutdown().await.job_failed.is_some());
    });
}

/// SHUT-2: once the barrier has said the job failed, calls still in flight are not drained for
/// the whole shutdown timeout (their work is for a job that failed): here the master's call to
/// worker 1 sleeps for a minute (a trainer waiting for a step that will never come), and every
/// member shuts down within seconds, the call aborted. Before, every member waited out the
/// shutdown timeout (60 s here; 300 s in the parameter server's local mode, longer than its
/// test's bound).
#[test]
fn a_failed_job_does_not_wait_for_calls_in_flight() {
    each_transport(60, |t| async move {
        let a = group_with(t, Duration::from_secs(60)).await;
        let waiting = wait_for_group(&a[1..]);
        let master = a[0].clone();
        let stuck = tokio::spawn(async move { master.rpc_async(1u32, sleep_ms, (60_000,)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let start = std::time::Instant::now();
        let report = a[0].shutdown_failed("trainer 2 failed", true).await;
        assert!(report.job_failed.is_some(), "{report:?}");
        for w in waiting {
            let r = w.await.unwrap();
            assert!(r.job_failed.is_some(), "{r:?}");
        }
        let took = start.elapsed();
        assert!(took < Duration::from_secs(15), "took {took:?}");
        assert!(stuck.await.unwrap().is_err(), "the call was aborted");
    });
}

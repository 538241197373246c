//! Failure detection in one process: a worker whose heartbeats stop (as a frozen process's
//! would: `testing::silence`) is declared failed by every peer within its failure timeout,
//! and everything that waits on it ends with `RpcError::PeerFailed` naming it; a worker whose
//! runtime is busy computing is not. Multi-process kills and freezes are in `faults.rs`.

use std::time::{Duration, Instant};

use integration_tests::*;
use rpc_core::testing::{self, start_group};
use rpc_core::{Agent, RpcError, Secret, Transport};

const TIMEOUT: Duration = Duration::from_millis(600);

async fn group(n: u32, t: Transport) -> Vec<Agent> {
    start_group(
        n,
        t,
        Secret::generate(),
        |_| registry(),
        |_, c| {
            c.with_heartbeat_interval(Duration::from_millis(100))
                .with_failure_timeout(TIMEOUT)
                .with_shutdown_timeout(Duration::from_secs(5))
        },
    )
    .await
    .expect("group starts")
}

fn is_failed(e: &RpcError, who: &str) -> bool {
    matches!(e, RpcError::PeerFailed { worker, .. } if worker == who)
}

/// LIVE-1, and the waits of the failure-detection issue: calls in flight (async and, over TCP,
/// blocking on the thread's own connection) end with `PeerFailed` within the timeout, new
/// calls fail at once, every peer hears the verdict once, a handler running for the failed
/// caller is cancelled, the survivors keep calling each other, and shutdown skips it.
#[test]
fn a_silent_worker_is_declared_failed_and_every_wait_on_it_ends() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        // Connections up, and a handler on worker0 running for worker1.
        assert_eq!(a[0].rpc_async(1u32, add, (1, 1)).await.unwrap(), 2);
        let key = 7_000 + a[0].local_addr().len() as u64;
        let for_1 = a[1].rpc_async(0u32, hang, (key, 60));
        let for_1 = tokio::spawn(for_1);
        let pending = tokio::spawn(a[0].rpc_async(1u32, hang, (1, 60)));
        let blocking = {
            let a0 = a[0].clone();
            std::thread::spawn(move || a0.rpc_sync(1u32, hang, (2, 60)))
        };
        let mut watch = a[0].watch_failures();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(a[0].failed_workers().is_empty(), "nobody failed yet");
        let silenced = Instant::now();
        testing::silence(&a[1], true);
        let verdict = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("a verdict within 5 s")
            .expect("the watch goes on");
        let took = silenced.elapsed();
        assert_eq!((verdict.rank, verdict.name.as_str()), (1, "worker1"));
        assert!(verdict.cause.contains("no heartbeat"), "{}", verdict.cause);
        // Silent since its last heartbeat, up to one interval before `silence`.
        assert!(
            took + Duration::from_millis(150) >= TIMEOUT,
            "declared after {took:?}, before the timeout"
        );
        assert!(took < TIMEOUT * 4, "declared only after {took:?}");
        let err = tokio::time::timeout(Duration::from_secs(5), pending)
            .await
            .expect("the pending call ends")
            .expect("joined")
            .unwrap_err();
        assert!(is_failed(&err, "worker1"), "{err:?}");
        assert!(err.to_string().contains("worker1"), "{err}");
        let err = blocking.join().expect("joined").unwrap_err();
        assert!(is_failed(&err, "worker1"), "{err:?}");
        // New calls fail at once, naming the worker.
        let start = Instant::now();
        let err = a[0].rpc_async(1u32, add, (1, 1)).await.unwrap_err();
        assert!(is_failed(&err, "worker1"), "{err:?}");
        assert!(start.elapsed() < Duration::from_millis(200));
        let a0 = a[0].clone();
        let err = tokio::task::spawn_blocking(move || a0.rpc_sync(1u32, add, (1, 1)))
            .await
            .unwrap()
            .unwrap_err();
        assert!(is_failed(&err, "worker1"), "{err:?}");
        // The handler worker0 ran for worker1 was cancelled.
        let by = Instant::now() + Duration::from_secs(5);
        while !was_cancelled(key) {
            assert!(
                Instant::now() < by,
                "the handler for a failed caller still runs"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // worker2 reached the same verdict on its own.
        let by = Instant::now() + Duration::from_secs(5);
        while a[2].failed_workers().is_empty() {
            assert!(Instant::now() < by, "worker2 never declared worker1 failed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(a[2].failed_workers()[0].rank, 1);
        assert_eq!(a[0].failed_workers().len(), 1, "one verdict per worker");
        // The survivors work on.
        assert_eq!(a[0].rpc_async(2u32, add, (2, 3)).await.unwrap(), 5);
        assert_eq!(a[2].rpc_async(0u32, add, (2, 3)).await.unwrap(), 5);
        // worker1 (silent, but running) is cut off from worker0: its call was answered by
        // nobody, and it fails once worker1 itself gives up on its peers' answers.
        drop(for_1);
        // Shutdown skips the failed worker and names it.
        let (r0, r2) = tokio::join!(a[0].shutdown(), a[2].shutdown());
        for r in [r0, r2] {
            let why = r.barrier.unwrap_err();
            assert!(why.contains("[1]"), "{why}");
        }
        let _ = a[1].shutdown_within(Duration::from_millis(500)).await;
    });
}

/// LIVE-2: a worker whose only runtime thread computes for several failure timeouts without
/// yielding is busy, not dead: its detector runs on a thread of its own.
#[test]
fn a_busy_runtime_is_not_declared_failed() {
    // One runtime thread for the whole group: the burning handler holds all of them.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), async {
            let a = group(2, Transport::Tcp).await;
            assert_eq!(a[0].rpc_async(1u32, add, (1, 1)).await.unwrap(), 2);
            let burned = a[0]
                .rpc_async(1u32, burn, (TIMEOUT.as_millis() as u64 * 5,))
                .await;
            assert!(burned.is_ok(), "{burned:?}");
            assert!(
                a[0].failed_workers().is_empty(),
                "{:?}",
                a[0].failed_workers()
            );
            assert!(
                a[1].failed_workers().is_empty(),
                "{:?}",
                a[1].failed_workers()
            );
            shutdown_all(&a).await;
        })
        .await
        .expect("within 60 s")
    });
}

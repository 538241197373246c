//! Failure detection in one process: a worker whose heartbeats stop (as a frozen process's
//! would: `testing::silence`) is declared failed by every peer within its failure timeout,
//! and everything that waits on it ends with `RpcError::PeerFailed` naming it; a worker whose
//! runtime is busy computing is not. Multi-process kills and freezes are in `faults.rs`.

use std::time::{Duration, Instant};

use integration_tests::autograd_fns::echo_tensor;
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

fn full_registry() -> rpc_core::Registry {
    let b = integration_tests::rref_fns::register(registry_builder());
    let b = integration_tests::autograd_fns::register(b);
    collectives::install(b).expect("distinct names").build()
}

/// OWN-5, CTX-3, AD-7, COL-2, PS-3: once a worker is declared failed, the values only it held
/// are released by their owner, the autograd contexts it started are released, receives from
/// it and collectives of its groups fail on every member (each error names it), and a
/// parameter-server pull waiting for its clock goes on without it: the BSP step is applied
/// with the live trainer's gradients, and the departed trainer's later calls are refused.
#[test]
fn the_layers_release_and_fail_what_a_failed_worker_held() {
    use autograd_dist::RTensor;
    use candle_core::{Device, Tensor, Var};
    use integration_tests::rref_fns::{keep, Tracked};
    run(60, async {
        let a = start_group(
            3,
            Transport::Tcp,
            Secret::generate(),
            |_| full_registry(),
            |_, c| {
                c.with_heartbeat_interval(Duration::from_millis(100))
                    .with_failure_timeout(TIMEOUT)
                    .with_shutdown_timeout(Duration::from_secs(5))
            },
        )
        .await
        .expect("group starts");
        // A value owned by worker0, held only by worker1.
        let v = rref::RRef::new(&a[0], Tracked::new(9_001, 1));
        a[0].rpc_async(1u32, keep, (1, v.clone())).await.unwrap();
        drop(v);
        let by = Instant::now() + Duration::from_secs(5);
        while rref::debug_info(&a[0]).pending_children > 0 {
            assert!(Instant::now() < by, "{:?}", rref::debug_info(&a[0]));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(rref::debug_info(&a[0]).owner_values, 1, "kept by worker1");
        // An autograd context worker1 started, with state on worker0.
        let ctx = autograd_dist::context(&a[1]);
        let w = Var::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let x = RTensor((w.as_tensor() * 2.0).unwrap());
        let a1 = a[1].clone();
        let back = ctx
            .run(async move { a1.rpc_async(0u32, echo_tensor, (x,)).await })
            .await
            .unwrap();
        assert_eq!(back.0.to_vec1::<f32>().unwrap(), [2.0, 4.0]);
        assert!(autograd_dist::live_contexts(&a[0]) >= 1);
        // Waits that depend on worker1: a receive from it on worker0, an all-reduce on the
        // world on worker0 and worker2 (worker0's ring neighbour is worker2, alive), and a
        // BSP pull on worker0's parameter server that needs worker1's push.
        let recv = {
            let a0 = a[0].clone();
            tokio::spawn(async move { collectives::recv(&a0, 1u32, 5).await })
        };
        let reduces: Vec<_> = [0usize, 2]
            .into_iter()
            .map(|i| {
                let ai = a[i].clone();
                tokio::spawn(async move {
                    let t = Tensor::ones(8, candle_core::DType::F32, &Device::Cpu).unwrap();
                    collectives::world(&ai)
                        .all_reduce(&t, collectives::ReduceOp::Sum)
                        .await
                })
            })
            .collect();
        let p = vec![Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap()];
        collectives::serve_shard(&a[0], 1, p, 0.1, collectives::Consistency::Bsp, 2)
            .expect("served");
        let t1 = collectives::PsClient::new(&a[1], vec![(0, 1)], 0);
        let t2 = collectives::PsClient::new(&a[2], vec![(0, 1)], 1);
        t1.pull(0).await.unwrap();
        let g = vec![vec![
            Tensor::ones(2, candle_core::DType::F32, &Device::Cpu).unwrap()
        ]];
        t2.pull(0).await.unwrap();
        t2.push(0, g).await.unwrap();
        let pull = tokio::spawn(async move { t2.pull(1).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!recv.is_finished() && !pull.is_finished());
        assert!(reduces.iter().all(|r| !r.is_finished()));

        testing::silence(&a[1], true);
        let within = Duration::from_secs(5);
        let err = tokio::time::timeout(within, recv)
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(&err, collectives::P2pError::PeerFailed { worker, .. } if worker == "worker1"),
            "{err:?}"
        );
        for r in reduces {
            let err = tokio::time::timeout(within, r)
                .await
                .unwrap()
                .unwrap()
                .unwrap_err();
            assert!(
                rpc_core::error_chain(&err).contains("worker1"),
                "{}",
                rpc_core::error_chain(&err)
            );
        }
        let params = tokio::time::timeout(within, pull)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        // Step 0 applied with trainer 1's gradient alone: 0 - 0.1 * 1.
        assert_eq!(params[0][0].to_vec1::<f32>().unwrap(), [-0.1, -0.1]);
        let stats = collectives::shard_stats(&a[0], 1).unwrap();
        assert_eq!(
            stats.clocks,
            [0, 1],
            "trainer 0 never pushed; trainer 1 did step 0"
        );
        // Calls as trainer 0 are refused now (here from worker2: worker1 itself is silenced).
        let stale = collectives::PsClient::new(&a[2], vec![(0, 1)], 0);
        let err = stale.pull(1).await.unwrap_err();
        assert!(
            rpc_core::error_chain(&err).contains("declared failed and left the shard"),
            "{}",
            rpc_core::error_chain(&err)
        );
        // A later collective of the group fails at once on the survivors.
        let start = Instant::now();
        let t = Tensor::ones(8, candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = collectives::world(&a[0])
            .all_reduce(&t, collectives::ReduceOp::Sum)
            .await
            .unwrap_err();
        assert!(rpc_core::error_chain(&err).contains("worker1"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(1));
        // The value only worker1 held is released; so is the context it started.
        let by = Instant::now() + within;
        while rref::debug_info(&a[0]).owner_values > 0 || autograd_dist::live_contexts(&a[0]) > 0 {
            assert!(
                Instant::now() < by,
                "left on worker0: {:?}, {} contexts",
                rref::debug_info(&a[0]),
                autograd_dist::live_contexts(&a[0])
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(ctx);
        let _ = tokio::join!(a[0].shutdown(), a[2].shutdown());
        let _ = a[1].shutdown_within(Duration::from_millis(500)).await;
    });
}

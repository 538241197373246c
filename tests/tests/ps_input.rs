//! The parameter server refuses, before anything changes, a push it cannot apply: nothing of
//! it is applied, no other trainer's gradient of the step is lost, and the trainer can push
//! the step again correctly. A client refuses a push that does not hold one list per shard.

use candle_core::{DType, Device, Tensor};
use collectives::{Consistency, PsClient};
use integration_tests::{run, shutdown_all};
use rpc_core::{MemoryNetwork, Transport};

const LR: f64 = 0.5;

fn grads(vals: [f64; 2], dtype: DType) -> Vec<Vec<Tensor>> {
    let g = |v: f64| {
        Tensor::new(&[v, v], &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    vec![vec![g(vals[0]), g(vals[1])]]
}

fn weights(shards: Vec<Vec<Tensor>>) -> Vec<f64> {
    shards[0]
        .iter()
        .flat_map(|t| t.to_vec1::<f64>().unwrap())
        .collect()
}

/// Two trainers, one step; trainer 1 first pushes its second gradient as f32 for an f64
/// parameter (seen on the old code: under BSP the shard dropped the whole step, trainer 0's
/// acknowledged gradient with it; under ASP it applied the first parameter's gradient and
/// failed on the second, so the correct retry applied the first twice).
#[test]
fn a_push_of_the_wrong_dtype_is_refused_and_loses_nothing() {
    for mode in [Consistency::Bsp, Consistency::Asp] {
        run(60, async move {
            let a = integration_tests::collective_group(3, Transport::Memory(MemoryNetwork::new()))
                .await;
            let zeros = || Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
            collectives::serve_shard(&a[0], 7, vec![zeros(), zeros()], LR, mode, 2)
                .expect("served");
            let t0 = PsClient::new(&a[1], vec![(0, 7)], 0);
            let t1 = PsClient::new(&a[2], vec![(0, 7)], 1);
            t0.pull(0).await.unwrap();
            t1.pull(0).await.unwrap();
            t0.push(0, grads([1.0, 2.0], DType::F64)).await.unwrap();
            let mut bad = grads([10.0, 20.0], DType::F64);
            bad[0][1] = bad[0][1].to_dtype(DType::F32).unwrap();
            let e = t1
                .push(0, bad)
                .await
                .expect_err("an f32 gradient for an f64 parameter");
            let chain = rpc_core::error_chain(&e);
            assert!(
                chain.contains("gradient of dtype f32 for one of dtype f64 (parameter 1)"),
                "{mode:?}: {chain}"
            );
            t1.push(0, grads([10.0, 20.0], DType::F64)).await.unwrap();
            let w = weights(t0.pull(1).await.unwrap());
            let want = [-LR * 11.0, -LR * 11.0, -LR * 22.0, -LR * 22.0];
            assert_eq!(w, want, "{mode:?}");
            let stats = collectives::shard_stats(&a[0], 7).unwrap();
            assert_eq!(stats.applied, vec![1, 1], "{mode:?}");
            shutdown_all(&a).await;
        });
    }
}

/// A push holds one list of gradients per shard of the client. With fewer, the shards left out
/// never heard of the step (under BSP the other trainers' next pulls waited for it until their
/// deadline); with more, the client panicked (an index out of bounds). Both are refused before
/// anything is sent, naming the trainer and both numbers.
#[test]
fn a_push_for_another_number_of_shards_is_refused_before_anything_is_sent() {
    run(60, async {
        let a =
            integration_tests::collective_group(3, Transport::Memory(MemoryNetwork::new())).await;
        let zeros = || Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
        for (server, shard) in [(0usize, 1u64), (1, 2)] {
            collectives::serve_shard(&a[server], shard, vec![zeros()], LR, Consistency::Bsp, 1)
                .expect("served");
        }
        let t = PsClient::new(&a[2], vec![(0, 1), (1, 2)], 0);
        t.pull(0).await.unwrap();
        for lists in [1usize, 3] {
            let grads: Vec<Vec<Tensor>> = (0..lists).map(|_| vec![zeros()]).collect();
            let e = t.push(0, grads).await.expect_err("refused");
            let e = rpc_core::error_chain(&e);
            let says = format!("trainer 0 pushed {lists} gradient lists for 2 shards");
            assert!(e.contains(&says), "{e}");
        }
        for (server, shard) in [(0usize, 1u64), (1, 2)] {
            let stats = collectives::shard_stats(&a[server], shard).unwrap();
            assert_eq!(stats.clocks, vec![0], "shard {shard}: nothing was pushed");
        }
        t.push(0, vec![vec![zeros()], vec![zeros()]]).await.unwrap();
        shutdown_all(&a).await;
    });
}

/// A shard is served once, with a learning rate and a number of trainers it can work with:
/// serving shard 7 again replaced it without a word (its parameters and every trainer's
/// clock, so a pushed step was lost and the trainer's next push was refused as ahead of its
/// clock), and a NaN or negative learning rate was taken (a NaN one made every parameter NaN
/// at the first push). Each is refused, naming the worker, the shard and the cause, and the
/// shard served keeps its state; retired, it hands its parameters back and may be served
/// again.
#[test]
fn a_shard_that_cannot_be_served_as_asked_is_refused() {
    run(60, async {
        let a =
            integration_tests::collective_group(2, Transport::Memory(MemoryNetwork::new())).await;
        let zeros = || Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
        let serve = |shard: u64, lr: f64, trainers: usize| {
            let served = collectives::serve_shard(
                &a[0],
                shard,
                vec![zeros()],
                lr,
                Consistency::Bsp,
                trainers,
            );
            served.err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert_eq!(serve(7, LR, 1), "");
        let t = PsClient::new(&a[1], vec![(0, 7)], 0);
        t.pull(0).await.unwrap();
        t.push(
            0,
            vec![vec![Tensor::new(&[1.0f64, 1.0], &Device::Cpu).unwrap()]],
        )
        .await
        .unwrap();
        for (shard, lr, trainers, says) in [
            (7, LR, 1, "shard 7 is already served"),
            (8, f64::NAN, 1, "learning rate NaN"),
            (8, -0.1, 1, "learning rate -0.1"),
            (8, LR, 0, "no trainers"),
        ] {
            let got = serve(shard, lr, trainers);
            assert!(got.contains(says) && got.contains("worker0"), "{got}");
        }
        assert!(collectives::shard_stats(&a[0], 8).is_none());
        let w = weights(t.pull(1).await.unwrap());
        assert_eq!(w, [-LR, -LR], "the served shard kept its step");
        // Retired, it hands back its parameters and may be served again.
        let kept = collectives::retire_shard(&a[0], 7).expect("served");
        assert_eq!(kept[0].to_vec1::<f64>().unwrap(), [-LR, -LR]);
        assert!(collectives::retire_shard(&a[0], 7).is_none());
        assert_eq!(serve(7, LR, 1), "");
        shutdown_all(&a).await;
    });
}

/// Two trainers that give the same trainer index (the second meant to be trainer 1): the
/// second's push was acknowledged as a retry of the first's and never applied, under ASP for
/// the whole run, without a word (under BSP the step then waited for trainer 1 until the
/// deadline). PS-10: the shard knows each index's rank from its pushes: a push from another rank
/// under that index is refused, naming both ranks.
#[test]
fn two_trainers_under_one_index_are_refused() {
    run(60, async {
        let a =
            integration_tests::collective_group(3, Transport::Memory(MemoryNetwork::new())).await;
        let zeros = || Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
        collectives::serve_shard(&a[0], 7, vec![zeros()], LR, Consistency::Asp, 2).expect("served");
        let first = PsClient::new(&a[1], vec![(0, 7)], 0);
        let second = PsClient::new(&a[2], vec![(0, 7)], 0);
        let g = |v: f64| vec![vec![Tensor::new(&[v, v], &Device::Cpu).unwrap()]];
        first.pull(0).await.unwrap();
        first.push(0, g(1.0)).await.unwrap();
        // A pull only reads (a program reads the parameters that way); a push is refused.
        second.pull(0).await.unwrap();
        for clock in [0, 1] {
            let got = second.push(clock, g(10.0)).await;
            let e = rpc_core::error_chain(&got.expect_err("another rank under trainer 0"));
            assert!(
                e.contains("trainer 0") && e.contains("rank 1") && e.contains("rank 2"),
                "{e}"
            );
        }
        let w = weights(first.pull(1).await.unwrap());
        assert_eq!(w, [-LR, -LR], "only the first trainer's step is in");
        shutdown_all(&a).await;
    });
}

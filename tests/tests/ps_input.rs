//! The parameter server refuses, before anything changes, a push it cannot apply: nothing of
//! it is applied, no other trainer's gradient of the step is lost, and the trainer can push
//! the step again correctly.

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
            collectives::serve_shard(&a[0], 7, vec![zeros(), zeros()], LR, mode, 2);
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

//! Distributed autograd across in-process workers (TCP and memory): gradients must equal the
//! single-process gradients of the same model and data (max abs difference <= 1e-6).

use std::time::Duration;

use autograd_dist::RTensor;
use candle_core::{DType, Device, IndexOp, Tensor, Var};
use integration_tests::autograd_fns::*;
use integration_tests::{each_transport, run, shutdown_all};
use rpc_core::testing::start_group;
use rpc_core::{Agent, Registry, Secret, Transport};

fn registry() -> Registry {
    register(rref::install(Registry::builder()).unwrap()).build()
}

async fn group(n: u32, t: Transport) -> Vec<Agent> {
    start_group(
        n,
        t,
        Secret::generate(),
        |_| registry(),
        |_, c| c.with_rpc_timeout(Duration::from_secs(20)),
    )
    .await
    .expect("group starts")
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

async fn remote_grad(a: &Agent, worker: u32, ctx: u64, w: &str) -> Tensor {
    a.rpc_async(worker, param_grad, (ctx, w.to_string()))
        .await
        .unwrap()
        .expect("a gradient")
        .0
}

async fn init(a: &Agent, worker: u32, w: &str, r: usize, c: usize) {
    a.rpc_async(worker, init_param, (w.to_string(), r, c))
        .await
        .unwrap();
}

fn local(w: &str, r: usize, c: usize) -> Var {
    Var::from_tensor(&init_value(w, r, c)).unwrap()
}

#[test]
fn mlp_split_over_three_workers_matches_one_process() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        init(&a[0], 0, "m.w0", 4, 8).await;
        init(&a[0], 1, "m.w1", 8, 6).await;
        init(&a[0], 2, "m.w2", 6, 3).await;
        let x = input(5, 4);
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let h0 = a[0]
                    .rpc_async(0u32, linear, ("m.w0".into(), RTensor(x.clone()), true))
                    .await
                    .unwrap();
                let h1 = a[0]
                    .rpc_async(1u32, linear, ("m.w1".into(), h0, true))
                    .await
                    .unwrap();
                let h2 = a[0]
                    .rpc_async(2u32, linear, ("m.w2".into(), h1, false))
                    .await
                    .unwrap();
                h2.0.sqr().unwrap().mean_all().unwrap()
            })
            .await;
        ctx.backward(std::slice::from_ref(&loss)).await.unwrap();
        // The same model in one process.
        let (w0, w1, w2) = (
            local("m.w0", 4, 8),
            local("m.w1", 8, 6),
            local("m.w2", 6, 3),
        );
        let l = x
            .matmul(w0.as_tensor())
            .unwrap()
            .relu()
            .unwrap()
            .matmul(w1.as_tensor())
            .unwrap()
            .relu()
            .unwrap()
            .matmul(w2.as_tensor())
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        assert!(max_abs_diff(&l, &loss) < 1e-12);
        let g = l.backward().unwrap();
        for (worker, w, var) in [(0u32, "m.w0", &w0), (1, "m.w1", &w1), (2, "m.w2", &w2)] {
            let d = max_abs_diff(
                &remote_grad(&a[0], worker, ctx.id(), w).await,
                g.get(var.as_tensor()).unwrap(),
            );
            assert!(d <= 1e-6, "{w}: max abs diff {d}");
        }
        ctx.release().await.unwrap();
        for w in 0..3u32 {
            assert_eq!(
                a[0].rpc_async(w, live_contexts, ()).await.unwrap(),
                0,
                "released on worker {w}"
            );
        }
        shutdown_all(&a).await;
    });
}

#[test]
fn round_trip_a_to_b_to_a_one_tensor_to_two_workers_and_unused_outputs() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        init(&a[0], 0, "r.w0", 3, 4).await;
        init(&a[0], 1, "r.w1", 4, 4).await;
        init(&a[0], 0, "r.v", 4, 2).await;
        init(&a[0], 2, "r.w2", 4, 2).await;
        let x = input(2, 3);
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let h0 = a[0]
                    .rpc_async(0u32, linear, ("r.w0".into(), RTensor(x.clone()), false))
                    .await
                    .unwrap();
                // A→B→A: worker1 applies w1, then calls worker0's `v` (nested), and returns.
                let r = a[0]
                    .rpc_async(
                        1u32,
                        linear_then,
                        ("r.w1".into(), h0.clone(), 0, "r.v".into()),
                    )
                    .await
                    .unwrap();
                // The same tensor to a second worker.
                let s = a[0]
                    .rpc_async(2u32, linear, ("r.w2".into(), h0.clone(), false))
                    .await
                    .unwrap();
                // An output that never reaches the loss.
                let _unused = a[0]
                    .rpc_async(2u32, linear, ("r.w2".into(), h0, true))
                    .await
                    .unwrap();
                (r.0 + s.0).unwrap().sum_all().unwrap()
            })
            .await;
        tokio::time::timeout(Duration::from_secs(10), ctx.backward(&[loss]))
            .await
            .expect("no hang")
            .unwrap();
        let (w0, w1, v, w2) = (
            local("r.w0", 3, 4),
            local("r.w1", 4, 4),
            local("r.v", 4, 2),
            local("r.w2", 4, 2),
        );
        let h0 = x.matmul(w0.as_tensor()).unwrap();
        let r = (h0
            .matmul(w1.as_tensor())
            .unwrap()
            .tanh()
            .unwrap()
            .matmul(v.as_tensor())
            .unwrap()
            * 2.0)
            .unwrap();
        let s = h0.matmul(w2.as_tensor()).unwrap();
        let g = (r + s).unwrap().sum_all().unwrap().backward().unwrap();
        for (worker, w, var) in [
            (0u32, "r.w0", &w0),
            (1, "r.w1", &w1),
            (0, "r.v", &v),
            (2, "r.w2", &w2),
        ] {
            let d = max_abs_diff(
                &remote_grad(&a[0], worker, ctx.id(), w).await,
                g.get(var.as_tensor()).unwrap(),
            );
            assert!(d <= 1e-6, "{w}: max abs diff {d}");
        }
        drop(ctx);
        shutdown_all(&a).await;
    });
}

#[test]
fn to_here_inside_a_context_and_concurrent_contexts() {
    each_transport(60, |t| async move {
        let a = group(2, t).await;
        init(&a[0], 1, "t.w1", 3, 3).await;
        let x = input(2, 3);
        let w1 = local("t.w1", 3, 3);
        // Two trainers' contexts at once, each with its own loss scale.
        let run_one = |scale: f64| {
            let a0 = a[0].clone();
            let x = x.clone();
            async move {
                let ctx = autograd_dist::context(&a0);
                let act =
                    rref::remote(&a0, 1u32, make_activation, ("t.w1".into(), RTensor(x))).unwrap();
                let loss = ctx
                    .run(async {
                        (act.to_here().await.unwrap().0.sum_all().unwrap() * scale).unwrap()
                    })
                    .await;
                ctx.backward(&[loss]).await.unwrap();
                let g = remote_grad(&a0, 1, ctx.id(), "t.w1").await;
                (ctx, g)
            }
        };
        let ((c1, g1), (c2, g2)) = tokio::join!(run_one(1.0), run_one(3.0));
        let expect = x
            .matmul(w1.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let e = expect.get(w1.as_tensor()).unwrap();
        assert!(max_abs_diff(&g1, e) <= 1e-6);
        assert!(
            max_abs_diff(&g2, &(e * 3.0).unwrap()) <= 1e-6,
            "contexts must not mix"
        );
        c1.release().await.unwrap();
        c2.release().await.unwrap();
        shutdown_all(&a).await;
    });
}

#[test]
fn tensors_of_every_dtype_and_layout_round_trip() {
    run(60, async {
        let a = group(2, Transport::Tcp).await;
        let base = Tensor::arange(0f64, 24., &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        for dt in [
            DType::U8,
            DType::U32,
            DType::I16,
            DType::I32,
            DType::I64,
            DType::BF16,
            DType::F16,
            DType::F32,
            DType::F64,
            DType::F8E4M3,
        ] {
            let t = base.to_dtype(dt).unwrap();
            for view in [
                t.clone(),
                t.permute((2, 0, 1)).unwrap().i((.., 1.., ..)).unwrap(),
            ] {
                let back = a[0]
                    .rpc_async(1u32, echo_tensor, (RTensor(view.clone()),))
                    .await
                    .unwrap();
                assert_eq!(back.dtype(), dt);
                assert_eq!(back.dims(), view.dims());
                // Bytes, not values: candle 0.11 overflows its stack converting F8E4M3 to F64.
                let (x, y) = (
                    RTensor(view.clone()).to_le_bytes().unwrap(),
                    back.to_le_bytes().unwrap(),
                );
                assert_eq!(x, y, "{dt:?}");
                assert!(back.is_contiguous());
            }
        }
        // Candle's packed formats (stored as raw bytes) round-trip too.
        for dt in [DType::F6E2M3, DType::F6E3M2, DType::F4, DType::F8E8M0] {
            let raw: Vec<u8> = (0..24u8).map(|i| i.wrapping_mul(37)).collect();
            let t = Tensor::from_raw_buffer(&raw, dt, &[2, 12], &Device::Cpu).unwrap();
            let back = a[0]
                .rpc_async(1u32, echo_tensor, (RTensor(t.clone()),))
                .await
                .unwrap();
            assert_eq!((back.dtype(), back.dims()), (dt, &[2usize, 12][..]));
            assert_eq!(
                back.to_le_bytes().unwrap(),
                RTensor(t).to_le_bytes().unwrap(),
                "{dt:?}"
            );
        }
        // Tensors through remote references: created remotely, an RRef method with a tensor
        // argument, to_here.
        let r = rref::RRef::new(&a[1], RTensor(base.clone()));
        let sum = a[1]
            .rpc_async(0u32, echo_tensor, (RTensor(base.clone()),))
            .await
            .unwrap();
        let shared = a[1]
            .rpc_async(0u32, keep_and_add, (r.clone(), sum))
            .await
            .unwrap();
        assert_eq!(
            shared
                .to_dtype(DType::F64)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
            2.0 * 276.0
        );
        assert_eq!(r.to_here().await.unwrap().dims(), &[2, 3, 4]);
        // A large tensor takes the bulk path.
        let big = Tensor::ones((1024, 1024), DType::F32, &Device::Cpu).unwrap();
        let back = a[0]
            .rpc_async(1u32, echo_tensor, (RTensor(big),))
            .await
            .unwrap();
        assert_eq!(
            back.sum_all().unwrap().to_scalar::<f32>().unwrap(),
            1024.0 * 1024.0
        );
        shutdown_all(&a).await;
    });
}

#[test]
fn a_dead_worker_fails_backward_naming_it() {
    run(60, async {
        let a = start_group(
            2,
            Transport::Tcp,
            Secret::generate(),
            |_| registry(),
            |_, c| {
                c.with_rpc_timeout(Duration::from_secs(3))
                    .with_shutdown_timeout(Duration::from_millis(300))
            },
        )
        .await
        .unwrap();
        init(&a[0], 1, "d.w1", 3, 3).await;
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let x = Var::from_tensor(&input(2, 3)).unwrap();
                let y = a[0]
                    .rpc_async(
                        1u32,
                        linear,
                        ("d.w1".into(), RTensor(x.as_tensor().clone()), false),
                    )
                    .await
                    .unwrap();
                y.0.sum_all().unwrap()
            })
            .await;
        let _ = a[1].shutdown().await;
        let err = tokio::time::timeout(Duration::from_secs(10), ctx.backward(&[loss]))
            .await
            .expect("bounded")
            .unwrap_err();
        let text = rpc_core::error_chain(&err);
        assert!(text.contains("worker1"), "{text}");
        drop(ctx);
        let _ = a[0].shutdown().await;
    });
}

#[test]
fn asking_for_cuda_without_support_is_an_error() {
    let err = "cuda:0"
        .parse::<autograd_dist::DeviceSpec>()
        .unwrap()
        .device()
        .unwrap_err();
    assert!(err.to_string().contains("cuda:0"), "{err}");
}

#[test]
fn device_maps_are_validated_at_install_and_applied_to_requests() {
    run(60, async {
        let a = group(3, Transport::Tcp).await;
        use autograd_dist::{DeviceMapError, DeviceMaps};
        let err = DeviceMaps::new()
            .map("nobody", "cpu", "cpu")
            .unwrap()
            .install(&a[0])
            .unwrap_err();
        assert!(matches!(err, DeviceMapError::UnknownPeer(_)), "{err}");
        let err = DeviceMaps::new()
            .map("worker0", "cpu", "cpu")
            .unwrap()
            .install(&a[0])
            .unwrap_err();
        assert!(matches!(err, DeviceMapError::SelfMap(_)), "{err}");
        let err = DeviceMaps::new()
            .map("worker1", "cuda:0", "cpu")
            .unwrap()
            .install(&a[0])
            .unwrap_err();
        assert!(
            rpc_core::error_chain(&err).contains("cuda:0"),
            "a local device that is not usable here: {err}"
        );
        // cpu -> cuda:0 for worker1: requests land on cuda:0 there, which this build lacks, so
        // the callee refuses the arguments with an error naming the device.
        DeviceMaps::new()
            .map("worker1", "cpu", "cuda:0")
            .unwrap()
            .install(&a[0])
            .unwrap();
        let t = RTensor(Tensor::ones(3, DType::F32, &Device::Cpu).unwrap());
        let err = a[0]
            .rpc_async(1u32, echo_tensor, (t.clone(),))
            .await
            .unwrap_err();
        assert!(rpc_core::error_chain(&err).contains("cuda:0"), "{err}");
        // Peers without a map are unaffected; a cpu -> cpu map changes nothing.
        assert_eq!(
            a[0].rpc_async(2u32, echo_tensor, (t.clone(),))
                .await
                .unwrap()
                .dims(),
            &[3]
        );
        DeviceMaps::new()
            .map("worker1", "cpu", "cpu")
            .unwrap()
            .install(&a[0])
            .unwrap();
        assert_eq!(
            a[0].rpc_async(1u32, echo_tensor, (t,))
                .await
                .unwrap()
                .dims(),
            &[3]
        );
        shutdown_all(&a).await;
    });
}

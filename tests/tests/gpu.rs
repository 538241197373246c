//! Tensors, distributed autograd, remote modules and collectives on CUDA devices.
//!
//! Every test here needs a usable GPU (`integration_tests::gpus`): without one it says on
//! stderr that it was skipped and why; under `scripts/gpu-check.sh` (`RPC_EXPECT_GPU=1`) a
//! missing GPU fails it instead. Build with `--features cuda` to run them on a GPU.

use std::time::Duration;

use autograd_dist::{
    DeviceMaps, DeviceSpec, DistributedOptimizer, OptimizerKind, RTensor, RemoteModule,
};
use candle_core::{DType, Device, Tensor};
use integration_tests::autograd_fns::*;
use integration_tests::{gpus, gpus_expected, max_abs_diff, run, shutdown_all};
use rpc_core::testing::start_group;
use rpc_core::{Agent, Registry, Secret, Transport};

async fn group(n: u32) -> Vec<Agent> {
    start_group(
        n,
        Transport::Tcp,
        Secret::generate(),
        |_| {
            let b = rref::install(Registry::builder()).unwrap();
            register(collectives::install(b).unwrap()).build()
        },
        |_, c| c.with_rpc_timeout(Duration::from_secs(60)),
    )
    .await
    .expect("group starts")
}

/// Where no GPU is usable the GPU tests skip with a message, and fail when one is expected.
#[test]
fn gpu_tests_are_skipped_with_a_message_and_fail_when_a_gpu_is_expected() {
    if autograd_dist::cuda_devices().is_ok_and(|n| n > 0) {
        assert!(gpus_expected("probe", 1, true).is_some());
        return;
    }
    assert_eq!(gpus_expected("probe", 1, false), None);
    let failed = std::panic::catch_unwind(|| gpus_expected("probe", 1, true)).unwrap_err();
    let text = failed.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        text.contains("GPU test probe: a GPU was expected (RPC_EXPECT_GPU=1) but cuda:0"),
        "{text}"
    );
}

/// DEV-1: `cuda:0` is one device in a process, and its work is ordered on one stream whatever
/// thread runs it: a chain of products launched on one thread and read on another reads the
/// finished result. (With candle's `Device::new_cuda`, each thread has its own default stream,
/// so the read may overtake the products.)
#[test]
fn cuda_0_is_one_device_ordered_on_one_stream_across_threads() {
    if gpus(
        "cuda_0_is_one_device_ordered_on_one_stream_across_threads",
        1,
    )
    .is_none()
    {
        return;
    }
    let dev = DeviceSpec::Cuda(0).device().unwrap();
    assert!(dev.same_device(&DeviceSpec::Cuda(0).device().unwrap()));
    for round in 0..5 {
        let d = dev.clone();
        let launched = on_a_thread(60, move || {
            let eye = Tensor::eye(4096, DType::F32, &d).unwrap();
            let mut x = Tensor::ones((4096, 4096), DType::F32, &d).unwrap();
            for _ in 0..10 {
                x = (x.matmul(&eye).unwrap() + 1.0).unwrap();
            }
            x
        });
        let read = on_a_thread(60, move || launched.to_device(&Device::Cpu).unwrap());
        let v: Vec<f32> = read.flatten_all().unwrap().to_vec1().unwrap();
        let wrong = v.iter().filter(|&&x| x != 11.0).count();
        assert_eq!(
            wrong, 0,
            "round {round}: {wrong} elements read before they were written"
        );
    }
}

/// `f`'s result, computed on a new thread; fails the test if that takes over `secs` seconds or
/// the thread panics.
fn on_a_thread<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("no result within {secs} s"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the thread panicked"),
    }
}

/// A CPU tensor sent to a worker whose device map sends it to `cuda:0` lands there, and the
/// reply comes back to the CPU through the inverse map, with the same values.
#[test]
fn a_tensor_lands_on_the_mapped_cuda_device_and_comes_back() {
    if gpus("a_tensor_lands_on_the_mapped_cuda_device", 1).is_none() {
        return;
    }
    run(120, async {
        let a = group(2).await;
        DeviceMaps::new()
            .map("worker1", "cpu", "cuda:0")
            .unwrap()
            .install(&a[0])
            .unwrap();
        let x = input(64, 33);
        let (there, back) = a[0]
            .rpc_async(1u32, device_of, (RTensor(x.clone()),))
            .await
            .unwrap();
        assert_eq!(there, "cuda:0");
        assert!(back.device().is_cpu());
        assert_eq!(max_abs_diff(&back.0, &x), 0.0);
        shutdown_all(&a).await;
    });
}

/// Two remote modules on `cuda:0` of two workers (held by RRefs), driven from a CPU master
/// inside a distributed autograd context: the loss, the gradients after a distributed
/// backward and the parameters after a distributed SGD step equal one process on the CPU
/// (f64, within 1e-9: cuBLAS sums in another order).
#[test]
fn remote_modules_on_cuda_train_like_one_process_on_the_cpu() {
    if gpus(
        "remote_modules_on_cuda_train_like_one_process_on_the_cpu",
        1,
    )
    .is_none()
    {
        return;
    }
    run(180, async {
        let a = group(3).await;
        let maps = DeviceMaps::new()
            .map("worker1", "cpu", "cuda:0")
            .unwrap()
            .map("worker2", "cpu", "cuda:0")
            .unwrap();
        maps.install(&a[0]).unwrap();
        DeviceMaps::new()
            .map("worker2", "cuda:0", "cuda:0")
            .unwrap()
            .install(&a[1])
            .unwrap();
        let s1: RemoteModule<StageLinear> =
            RemoteModule::new(&a[0], "worker1/cuda:0", ("g.w1".into(), 16, 24, true))
                .await
                .unwrap();
        let s2: RemoteModule<StageLinear> =
            RemoteModule::new(&a[0], "worker2/cuda:0", ("g.w2".into(), 24, 5, false))
                .await
                .unwrap();
        let x = input(8, 16);
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let h = s1.forward(x.clone()).await.unwrap();
                let y = s2.forward(h).await.unwrap();
                assert!(y.device().is_cpu(), "the reply comes back to the CPU");
                y.sqr().unwrap().mean_all().unwrap()
            })
            .await;
        ctx.backward(std::slice::from_ref(&loss)).await.unwrap();
        let mut params = s1.remote_parameters().await.unwrap();
        params.extend(s2.remote_parameters().await.unwrap());
        let opt = DistributedOptimizer::new(&a[0], OptimizerKind::sgd(0.1), params).unwrap();
        opt.step(&ctx).await.unwrap();
        // One process on the CPU.
        let w1 = candle_core::Var::from_tensor(&init_value("g.w1", 16, 24)).unwrap();
        let w2 = candle_core::Var::from_tensor(&init_value("g.w2", 24, 5)).unwrap();
        let l = x
            .matmul(w1.as_tensor())
            .and_then(|h| h.relu())
            .and_then(|h| h.matmul(w2.as_tensor()))
            .and_then(|y| y.sqr())
            .and_then(|y| y.mean_all())
            .unwrap();
        assert!(max_abs_diff(&l, &loss) < 1e-9, "loss");
        let g = l.backward().unwrap();
        let mut sgd =
            autograd_dist::Optimizer::new(OptimizerKind::sgd(0.1), vec![w1.clone(), w2.clone()]);
        sgd.step(&g).unwrap();
        for (m, w) in [(&s1, &w1), (&s2, &w2)] {
            let state = m.state().await.unwrap();
            let d = max_abs_diff(&state[0].to_device(&Device::Cpu).unwrap(), w.as_tensor());
            assert!(d <= 1e-9, "after one SGD step on cuda:0: max abs diff {d}");
        }
        drop(ctx);
        shutdown_all(&a).await;
    });
}

/// Collectives of CUDA tensors go through NCCL (one GPU per member: NCCL refuses two ranks
/// on one device) and equal the ring's results on CPU copies: all-reduce (sum, mean, max),
/// broadcast, all-gather, reduce-scatter with chunks of unequal size, reduce, gather, and two
/// asynchronous all-reduces in flight at once; a shape mismatch, roots that differ and
/// reductions that differ each fail both members with one message before NCCL sees a buffer.
#[test]
fn nccl_collectives_equal_the_ring() {
    if gpus("nccl_collectives_equal_the_ring", 2).is_none() {
        return;
    }
    cuda_collectives_equal_the_ring([0, 1]);
}

/// NC-5: NCCL refuses two members on one GPU ("ncclCommInitRank failed: invalid usage", as
/// `hybrid-rnn` with both shards on `cuda:0` met on an H200), so members that share a GPU
/// agree, from the devices their first exchange names, to run the operation through host
/// memory and the ring: every collective of [`nccl_collectives_equal_the_ring`] then gives
/// the ring's results, on the GPU.
#[test]
fn members_sharing_a_gpu_get_the_ring_s_results_on_it() {
    if gpus("members_sharing_a_gpu_get_the_ring_s_results_on_it", 1).is_none() {
        return;
    }
    cuda_collectives_equal_the_ring([0, 0]);
}

/// Two members, member `i` on `cuda:devices[i]`: every collective of a CUDA tensor equals the
/// ring's on the CPU, and a shape mismatch, roots that differ and reductions that differ each
/// fail both with one message.
fn cuda_collectives_equal_the_ring(devices: [usize; 2]) {
    use collectives::ReduceOp;
    run(240, async {
        let a = group(2).await;
        let work = a.iter().enumerate().map(|(i, agent)| async move {
            let g = collectives::world(agent);
            let dev = DeviceSpec::Cuda(devices[i]).device().unwrap();
            let x = (input(37, 11).to_dtype(DType::F32).unwrap() * (i as f64 + 1.0)).unwrap();
            let xg = x.to_device(&dev).unwrap();
            let cpu = |t: Tensor| t.to_device(&Device::Cpu).unwrap();
            let f64s = |t: Tensor| t.to_dtype(DType::F64).unwrap();
            let mut diffs = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                let gpu = g.all_reduce(&xg, op).await.unwrap();
                assert!(gpu.device().is_cuda());
                let ring = g.all_reduce(&x, op).await.unwrap();
                diffs.push(max_abs_diff(&f64s(cpu(gpu)), &f64s(ring)));
            }
            let b = g.broadcast(&xg, 1).await.unwrap();
            let rb = g.broadcast(&x, 1).await.unwrap();
            diffs.push(max_abs_diff(&f64s(cpu(b)), &f64s(rb)));
            let all = g.all_gather(&xg).await.unwrap();
            let rall = g.all_gather(&x).await.unwrap();
            for (p, q) in all.into_iter().zip(rall) {
                diffs.push(max_abs_diff(&f64s(cpu(p)), &f64s(q)));
            }
            // 37 * 11 = 407 elements over 2 members: chunks of 204 and 203.
            let rs = g.reduce_scatter(&xg, ReduceOp::Sum).await.unwrap();
            let rrs = g.reduce_scatter(&x, ReduceOp::Sum).await.unwrap();
            assert_eq!(rs.dims(), rrs.dims());
            diffs.push(max_abs_diff(&f64s(cpu(rs)), &f64s(rrs)));
            let r = g.reduce(&xg, ReduceOp::Sum, 0).await.unwrap();
            let rr = g.reduce(&x, ReduceOp::Sum, 0).await.unwrap();
            assert_eq!(r.is_some(), i == 0);
            if let (Some(r), Some(rr)) = (r, rr) {
                diffs.push(max_abs_diff(&f64s(cpu(r)), &f64s(rr)));
            }
            let gathered = g.gather(&xg, 1).await.unwrap();
            let rgathered = g.gather(&x, 1).await.unwrap();
            assert_eq!(gathered.is_some(), i == 1);
            for (p, q) in gathered
                .into_iter()
                .flatten()
                .zip(rgathered.into_iter().flatten())
            {
                diffs.push(max_abs_diff(&f64s(cpu(p)), &f64s(q)));
            }
            let w1 = g.all_reduce_async(&xg, ReduceOp::Sum);
            let w2 = g.all_reduce_async(&(&xg * 2.0).unwrap(), ReduceOp::Sum);
            let (r1, r2) = (w1.wait().await.unwrap(), w2.wait().await.unwrap());
            let twice = f64s((cpu(r1) * 2.0).unwrap());
            diffs.push(max_abs_diff(&twice, &f64s(cpu(r2))));
            // Shapes that differ: one verdict, the same message on both members (COL-1).
            let odd = if i == 0 {
                xg.clone()
            } else {
                xg.narrow(0, 0, 5).unwrap()
            };
            let e = g.all_reduce(&odd, ReduceOp::Sum).await.unwrap_err();
            // Roots that differ (ROOT-1) and reductions that differ (COL-1): found in NC-2's
            // exchange of headers, one verdict, before NCCL sees a buffer.
            let e_root = g.broadcast(&xg, i as u32).await.unwrap_err();
            let op = if i == 0 { ReduceOp::Sum } else { ReduceOp::Max };
            let e_op = g.all_reduce(&xg, op).await.unwrap_err();
            (diffs, [e, e_root, e_op].map(|e| e.to_string()))
        });
        let mut messages = Vec::new();
        for (diffs, message) in futures::future::join_all(work).await {
            for d in diffs {
                assert!(d <= 1e-5, "NCCL against the ring: max abs diff {d}");
            }
            messages.push(message);
        }
        let [shape, root, op] = &messages[0];
        assert!(shape.contains("shape"), "{shape}");
        assert!(root.contains("root 0") && root.contains("root 1"), "{root}");
        assert!(op.contains("max") && op.contains("sum"), "{op}");
        assert_eq!(messages[0], messages[1]);
        shutdown_all(&a).await;
    });
}

/// `scripts/gpu-check.sh` where no GPU exists fails at once and says so: it never reports GPU
/// checks that did not run.
#[test]
fn the_gpu_check_script_fails_loudly_where_no_gpu_exists() {
    let listed = std::process::Command::new("nvidia-smi").arg("-L").output();
    if listed.is_ok_and(|o| o.status.success() && !o.stdout.is_empty()) {
        eprintln!("skipped: this machine has a GPU (scripts/gpu-check.sh runs the checks)");
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("timeout")
        .args(["60", "bash", "scripts/gpu-check.sh", "run"])
        .current_dir(&root)
        .output()
        .expect("bash runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.starts_with("{\"check\":\"gpu\",\"ok\":false,\"error\":\"no GPU"),
        "{stdout}"
    );
    assert_eq!(stdout.lines().count(), 1, "no other check ran: {stdout}");
    assert!(
        stderr.contains("gpu-check: a GPU was expected and none was found"),
        "{stderr}"
    );
}

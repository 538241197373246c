//! Data parallelism with the gradients' combination overlapped with backward (DDP-1..4):
//! N replicas on B/N rows each track one process on B rows; the combination of a segment's
//! buckets starts while an earlier segment's backward still runs, a `grad_once` weight's while
//! its own segment's does; compressed buckets stay within their error bound; a pass that uses
//! its parameters differently from the first fails naming the parameter.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use autograd_dist::{Optimizer, OptimizerKind};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var};
use collectives::{
    CommHook, CompressHook, DistributedDataParallel, Pass, ProcessGroup, ReduceOp, Work,
};
use integration_tests::{max_abs_diff, run, shutdown_all};

mod ddp_model;
use ddp_model::{dataset, group, init_params, loss, model, moved, passes, rows, Model, ROWS};

const B: usize = 8;
const LR: f64 = 0.5;
const STEPS: usize = 20;

/// One process on batches of B rows.
fn one_process() -> Vec<Var> {
    let (x, y) = dataset();
    let p = init_params(0.0);
    let mut opt = Optimizer::new(OptimizerKind::sgd(LR), p.clone());
    let sampler = collectives::DistributedSampler::new(ROWS, 1, 0, 99);
    for step in 0..STEPS {
        let (epoch, k) = ((step * B / ROWS) as u64, step % (ROWS / B));
        let idx = &sampler.permutation(epoch)[k * B..(k + 1) * B];
        let l = loss(&p, &rows(&x, idx), &rows(&y, idx), |h| h.clone());
        opt.step(&l.backward().unwrap()).unwrap();
    }
    p
}

/// N replicas with `hook` (none: after backward, through reduce_gradients).
async fn replicas(n: u32, overlap: bool, hook: Option<CompressHook>) -> Vec<Vec<Tensor>> {
    replicas_with(n, overlap, hook, OptimizerKind::sgd(LR)).await
}

/// [`replicas`] with the optimizer `kind`.
async fn replicas_with(
    n: u32,
    overlap: bool,
    hook: Option<CompressHook>,
    kind: OptimizerKind,
) -> Vec<Vec<Tensor>> {
    let a = group(n).await;
    let (x, y) = dataset();
    let out = futures::future::join_all(a.iter().map(|w| {
        let (x, y) = (x.clone(), y.clone());
        async move {
            let r = w.rank() as usize;
            // Small buckets: several per segment.
            let ddp = DistributedDataParallel::with_bucket_bytes(
                collectives::world(w),
                init_params(r as f64 * 0.3),
                200,
            )
            .await
            .unwrap();
            let ddp = match hook {
                Some(h) => ddp.with_hook(h),
                None => ddp,
            };
            let opt = Optimizer::new(kind, ddp.vars().to_vec());
            let mut opt = ddp.wrap(opt);
            let sampler = collectives::DistributedSampler::new(ROWS, n as usize, r, 99);
            let b = B / n as usize;
            for step in 0..STEPS {
                let (epoch, k) = ((step * B / ROWS) as u64, step % (ROWS / B));
                let idx = &sampler.indices(epoch)[k * b..(k + 1) * b];
                let (xs, ys) = (rows(&x, idx), rows(&y, idx));
                if overlap {
                    let mut pass = opt.pass();
                    let l = loss(ddp.vars(), &xs, &ys, |h| pass.cut(h).unwrap());
                    opt.backward_step(pass, &l).await.unwrap();
                } else {
                    let l = loss(ddp.vars(), &xs, &ys, |h| h.clone());
                    let mut g = autograd_dist::grad_once::backward(&l).unwrap();
                    ddp.reduce_gradients(&mut g).await.unwrap();
                    opt.optimizer().step(&g).unwrap();
                }
            }
            ddp.vars()
                .iter()
                .map(|v| v.as_tensor().clone())
                .collect::<Vec<_>>()
        }
    }))
    .await;
    shutdown_all(&a).await;
    out
}

/// DDP-3: overlapped or not, N replicas on B/N rows end where one process on B rows does
/// (20 SGD steps, within 1e-5), the unused parameter included (it stays where the first rank
/// put it).
#[test]
fn replicas_track_one_process_overlapped_or_not() {
    run(180, async {
        let reference = one_process();
        let moved = max_abs_diff(reference[4].as_tensor(), init_params(0.0)[4].as_tensor());
        assert!(
            moved > 1e-3,
            "training moved the parameters by only {moved}"
        );
        for n in [2u32, 4] {
            for overlap in [true, false] {
                let finals = replicas(n, overlap, None).await;
                for (rank, params) in finals.iter().enumerate() {
                    for (i, (p, q)) in params.iter().zip(&reference).enumerate() {
                        let d = max_abs_diff(p, q.as_tensor());
                        assert!(d <= 1e-5, "n={n} overlap={overlap} rank {rank} p{i}: {d}");
                    }
                }
            }
        }
    });
}

/// DDP-9: a parameter that no member used in a step gets no gradient from the wrapper, as in
/// one process, where the optimizer skips it: AdamW's decoupled weight decay leaves the
/// unused parameter where rank 0 put it, overlapped or not (a zero gradient would decay it),
/// while the used ones train.
#[test]
fn a_parameter_no_member_used_is_left_alone_by_the_optimizer() {
    run(180, async {
        let start = init_params(0.0);
        for overlap in [true, false] {
            let finals = replicas_with(2, overlap, None, OptimizerKind::adamw(0.05)).await;
            for (rank, params) in finals.iter().enumerate() {
                let d = max_abs_diff(&params[6], start[6].as_tensor());
                assert_eq!(
                    d, 0.0,
                    "overlap={overlap} rank {rank}: the unused one moved"
                );
                let d = max_abs_diff(&params[4], start[4].as_tensor());
                assert!(
                    d > 1e-3,
                    "overlap={overlap} rank {rank}: a used one moved {d}"
                );
            }
        }
    });
}

/// Compressed buckets: the training stays within the 16-bit rounding of the exact one.
#[test]
fn compressed_buckets_stay_within_their_rounding() {
    run(180, async {
        let reference = one_process();
        for (hook, bound) in [(CompressHook::bf16(), 1e-4), (CompressHook::f16(), 3e-5)] {
            let finals = replicas(4, true, Some(hook)).await;
            let mut worst = 0f64;
            for params in &finals {
                for (p, q) in params.iter().zip(&reference) {
                    worst = worst.max(max_abs_diff(p, q.as_tensor()));
                }
            }
            assert!(worst <= bound, "{}: {worst}", hook.name());
            assert!(worst > 0.0, "{}: no rounding at all?", hook.name());
            eprintln!(
                "{}: parameters within {worst} of the exact run",
                hook.name()
            );
        }
    });
}

/// An op that is the identity forward and sleeps in its backward, noting when that began.
struct SlowBackward(Arc<Mutex<Option<Instant>>>);

impl CustomOp1 for SlowBackward {
    fn name(&self) -> &'static str {
        "slow-backward"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F64(v) = s else {
            candle_core::bail!("f64 only")
        };
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("contiguous only")
        };
        Ok((CpuStorage::F64(v[a..b].to_vec()), l.shape().clone()))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        *self.0.lock().unwrap() = Some(Instant::now());
        std::thread::sleep(Duration::from_millis(400));
        Ok(Some(g.clone()))
    }
}

/// A hook that notes when each bucket was handed to it.
struct Noting(Arc<Mutex<Vec<Instant>>>);

impl CommHook for Noting {
    fn reduce(&self, group: &ProcessGroup, bucket: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.0.lock().unwrap().push(Instant::now());
        group.all_reduce_async(&bucket, op)
    }
    fn name(&self) -> &'static str {
        "noting"
    }
}

/// Two passes on each of two members, with a slow op (its backward sleeps 400 ms) between the
/// input and `model` (given the pass, the parameters, the slow op's output and the targets):
/// for each member and pass, when the first bucket reached the hook and when the slow op's
/// backward began.
fn first_bucket_and_slow_op(
    params: Vec<Var>,
    bucket_bytes: usize,
    model: fn(&mut Pass<'_>, &[Var], &Tensor, &Tensor) -> Tensor,
) -> Vec<[(Instant, Instant); 2]> {
    run(60, async {
        let a = group(2).await;
        let (x, y) = dataset();
        let out = futures::future::join_all(a.iter().map(|w| {
            let (x, y, params) = (x.clone(), y.clone(), params.clone());
            async move {
                let started = Arc::new(Mutex::new(Vec::new()));
                let ddp = DistributedDataParallel::with_bucket_bytes(
                    collectives::world(w),
                    params,
                    bucket_bytes,
                )
                .await
                .unwrap()
                .with_hook(Noting(Arc::clone(&started)));
                let mut times = Vec::new();
                for _ in 0..2 {
                    started.lock().unwrap().clear();
                    let slow_began = Arc::new(Mutex::new(None));
                    let mut pass = ddp.pass();
                    // The slow op's backward needs a gradient at its input: a variable.
                    let input = Var::from_tensor(&x).unwrap();
                    let slow = input
                        .as_tensor()
                        .apply_op1(SlowBackward(Arc::clone(&slow_began)))
                        .unwrap();
                    let l = model(&mut pass, ddp.vars(), &slow, &y);
                    let _ = pass.backward(&l).await.unwrap();
                    let began = slow_began.lock().unwrap().expect("the slow backward ran");
                    times.push((started.lock().unwrap()[0], began));
                }
                [times[0], times[1]]
            }
        }))
        .await;
        shutdown_all(&a).await;
        out
    })
}

/// DDP-1: in the second pass (the first learns the buckets), the last segment's buckets are
/// handed to the hook before the first segment's (slow) backward starts.
#[test]
fn buckets_leave_while_earlier_segments_backpropagate() {
    // The slow op's backward runs in the first segment.
    let model = |pass: &mut Pass<'_>, p: &[Var], slow: &Tensor, y: &Tensor| {
        loss(p, slow, y, |h| pass.cut(h).unwrap())
    };
    for [(first0, began0), (first1, began1)] in
        first_bucket_and_slow_op(init_params(0.0), 200, model)
    {
        assert!(first0 > began0, "the first pass combines at its end");
        assert!(
            first1 < began1,
            "the first bucket left after the first segment's backward began"
        );
    }
}

/// DDP-2: a pass in which a parameter gets its gradient in an earlier segment than in the
/// first pass (after its bucket left) fails, naming the parameter, on every member.
#[test]
fn a_pass_that_moves_a_parameter_fails_naming_it() {
    let out = passes(2, |i, _| if i == 1 { moved } else { model });
    assert!(out[0].0.iter().all(Result::is_ok), "{:?}", out[0]);
    for o in &out[1].0 {
        let e = o.as_ref().unwrap_err();
        assert!(e.contains("parameter 4 got a gradient in segment 0"), "{e}");
    }
}

/// DDP-4: from the second pass on, a bucket of weights whose gradients `grad_once` hands over
/// leaves as soon as the last of them is computed, while its own segment's backward goes on
/// below the layer (here one segment, no cut: a slow op feeds the layer). The first pass, which
/// learns the buckets, combines at its end.
#[test]
fn a_weight_s_bucket_leaves_while_its_own_segment_backpropagates() {
    let model = |_: &mut Pass<'_>, p: &[Var], slow: &Tensor, _: &Tensor| {
        let h = autograd_dist::grad_once::matmul(slow, p[0].as_tensor()).unwrap();
        h.tanh().unwrap().sqr().unwrap().mean_all().unwrap()
    };
    let weight = vec![init_params(0.0)[0].clone()];
    for [(first0, began0), (first1, began1)] in first_bucket_and_slow_op(weight, 1 << 20, model) {
        // The slow op's backward sleeps 400 ms: its segment ends after that.
        let wait = Duration::from_millis(400);
        assert!(first0 > began0 + wait, "the first pass combines at its end");
        assert!(
            first1 < began1 + wait,
            "the bucket waited for the segment's end"
        );
    }
}

/// DDP-4: a weight whose whole gradient was one product in the first pass, used twice in a
/// later one, gets its second part after its bucket left: the pass fails, naming it, on
/// every member, rather than send an incomplete sum.
#[test]
fn a_weight_used_again_after_its_bucket_left_fails_naming_it() {
    // Parameter 2 (the middle layer's `grad_once` weight) twice in its segment.
    let twice: Model = |pass, p, x, y| {
        let mut cuts = 0;
        loss(p, x, y, |h| {
            cuts += 1;
            let h = match cuts {
                2 => {
                    let w = p[2].as_tensor();
                    let h = autograd_dist::grad_once::matmul(h, w).unwrap();
                    autograd_dist::grad_once::matmul(&h.tanh().unwrap(), w).unwrap()
                }
                _ => h.clone(),
            };
            pass.cut(&h).unwrap()
        })
    };
    let out = passes(2, |i, _| if i == 1 { twice } else { model });
    assert!(out[0].0.iter().all(Result::is_ok), "{:?}", out[0]);
    for o in &out[1].0 {
        let e = o.as_ref().unwrap_err();
        assert!(
            e.contains("parameter 2 got more gradient after its bucket was sent"),
            "{e}"
        );
    }
}

/// A model whose parameters are of two dtypes (an f32 weight, an f64 scale: a mixed-precision
/// model's layout): each bucket holds one dtype, as PyTorch's DDP's do. The concatenation of a
/// bucket that mixed them failed every pass, after backward and overlapped ("dtype mismatch in
/// cat"); now two replicas on two rows each track one process on the four.
#[test]
fn parameters_of_two_dtypes_are_bucketed_apart() {
    use candle_core::{DType, Device};
    let params = || {
        let w = Tensor::arange(0f32, 12., &Device::Cpu).unwrap();
        let w = (w.reshape((4, 3)).unwrap() * 0.1).unwrap();
        let s = Tensor::new(&[1f64, -2., 0.5], &Device::Cpu).unwrap();
        vec![Var::from_tensor(&w).unwrap(), Var::from_tensor(&s).unwrap()]
    };
    let xs = |rows: &[f32]| {
        let v: Vec<f32> = rows.iter().flat_map(|&r| [r, -r, 0.5 * r, 1.0]).collect();
        Tensor::from_vec(v, (rows.len(), 4), &Device::Cpu).unwrap()
    };
    let loss = |p: &[Var], x: &Tensor, cut: &mut dyn FnMut(&Tensor) -> Tensor| {
        let h = cut(&x.matmul(p[0].as_tensor()).unwrap());
        let h = h.to_dtype(DType::F64).unwrap();
        let y = h.broadcast_mul(p[1].as_tensor()).unwrap();
        y.sqr().unwrap().mean_all().unwrap()
    };
    let one = params();
    let mut opt = Optimizer::new(OptimizerKind::sgd(LR), one.clone());
    let l = loss(&one, &xs(&[1., 2., 3., 4.]), &mut |h| h.clone());
    opt.step(&l.backward().unwrap()).unwrap();
    for overlap in [false, true] {
        let got = run(60, async {
            let a = group(2).await;
            let outs = futures::future::join_all(a.iter().map(|w| async move {
                let ddp = DistributedDataParallel::new(collectives::world(w), params())
                    .await
                    .unwrap();
                let mut opt = ddp.wrap(Optimizer::new(OptimizerKind::sgd(LR), ddp.vars().to_vec()));
                let r = w.rank() as f32;
                let x = xs(&[1. + 2. * r, 2. + 2. * r]);
                if overlap {
                    let mut pass = opt.pass();
                    let l = loss(ddp.vars(), &x, &mut |h| pass.cut(h).unwrap());
                    opt.backward_step(pass, &l).await.unwrap();
                } else {
                    let l = loss(ddp.vars(), &x, &mut |h| h.clone());
                    let mut g = autograd_dist::grad_once::backward(&l).unwrap();
                    ddp.reduce_gradients(&mut g).await.unwrap();
                    opt.optimizer().step(&g).unwrap();
                }
                ddp.vars().to_vec()
            }))
            .await;
            shutdown_all(&a).await;
            outs
        });
        for (rank, p) in got.iter().enumerate() {
            for (q, o) in p.iter().zip(&one) {
                let f64 = |v: &Var| v.as_tensor().to_dtype(DType::F64).unwrap();
                let d = max_abs_diff(&f64(q), &f64(o));
                assert!(d <= 1e-5, "overlap {overlap}, rank {rank}: differs by {d}");
            }
        }
    }
}

/// DDP-2 across members: the plan must be the group's, not each member's. Here a weight is
/// used on rank 0's first batch and not on rank 1's (an expert that batch did not pick), so
/// rank 0 put it in its segment's buckets and rank 1 among the unused ones, sent last: from
/// the second pass on, with a bucket per parameter, rank 0's second all-reduce (that weight)
/// paired with rank 1's (another weight of the same length), and each member stepped with
/// the mean of two different parameters' gradients, without a word.
#[test]
fn members_whose_first_passes_differ_share_one_plan() {
    use candle_core::{DType, Device};
    let v = |x: f64| Var::from_tensor(&Tensor::full(x, 4, &Device::Cpu).unwrap()).unwrap();
    let input = |rank: u32| Tensor::full(1.0 + rank as f64, 4, &Device::Cpu).unwrap();
    // w0 and the expert w1 before the cut, w2 after it.
    let forward = |p: &[Var], x: &Tensor, expert: bool, cut: &mut dyn FnMut(&Tensor) -> Tensor| {
        let mut h = (x * p[0].as_tensor()).unwrap();
        if expert {
            h = (h + (x * p[1].as_tensor()).unwrap().sqr().unwrap()).unwrap();
        }
        let h = cut(&h);
        (h * p[2].as_tensor())
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let params = || vec![v(0.5), v(-0.25), v(2.0)];
    // Each member's own gradients in the second pass (both use the expert), and their mean.
    let local = |rank: u32| {
        let p = params();
        let g = forward(&p, &input(rank), true, &mut |h| h.clone())
            .backward()
            .unwrap();
        p.iter()
            .map(|w| g.get(w.as_tensor()).unwrap().to_vec1::<f64>().unwrap())
            .collect::<Vec<_>>()
    };
    let (g0, g1) = (local(0), local(1));
    let mean: Vec<Vec<f64>> = g0
        .iter()
        .zip(&g1)
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x + y) / 2.0).collect())
        .collect();
    let got = run(60, async {
        let a = group(2).await;
        let outs = futures::future::join_all(a.iter().map(|w| async move {
            let g = collectives::world(w);
            let ddp = DistributedDataParallel::with_bucket_bytes(g, params(), 1)
                .await
                .unwrap();
            let r = w.rank();
            let mut combined = Vec::new();
            for expert in [r == 0, true] {
                let mut pass = ddp.pass();
                let l = forward(ddp.vars(), &input(r), expert, &mut |h| pass.cut(h).unwrap());
                let g = pass.backward(&l).await.unwrap();
                combined = ddp
                    .vars()
                    .iter()
                    .map(|v| g.get(v.as_tensor()).unwrap().to_dtype(DType::F64).unwrap())
                    .map(|t| t.to_vec1::<f64>().unwrap())
                    .collect::<Vec<_>>();
            }
            combined
        }))
        .await;
        shutdown_all(&a).await;
        outs
    });
    for (rank, g) in got.iter().enumerate() {
        assert_eq!(
            g, &mean,
            "rank {rank}: the second pass's combined gradients"
        );
    }
}

/// DDP-7: a model cut after every layer, each layer a `grad_once` weight and a bias. Each
/// weight's bucket leaves as its product is computed; the biases, a few bytes each, go
/// together with the last segment's buckets instead of costing an all-reduce per layer: 4
/// weights' buckets and one of the 4 biases a pass (it was 8: a bias bucket per layer). The
/// replicas' parameters still equal one process's on both halves of the batch.
#[test]
fn biases_ride_with_the_next_segments_buckets() {
    use candle_core::Device;
    const LAYERS: usize = 4;
    let params = || {
        (0..LAYERS)
            .flat_map(|l| {
                let w: Vec<f64> = (0..64)
                    .map(|i| ((i * 7 + l) % 11) as f64 * 0.05 - 0.25)
                    .collect();
                let w = Tensor::from_vec(w, (8, 8), &Device::Cpu).unwrap();
                let b = Tensor::full(0.1 * l as f64, 8, &Device::Cpu).unwrap();
                [Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap()]
            })
            .collect::<Vec<_>>()
    };
    let input = |rank: usize| {
        let v: Vec<f64> = (0..16)
            .map(|i| (i + 16 * rank) as f64 * 0.03 - 0.2)
            .collect();
        Tensor::from_vec(v, (2, 8), &Device::Cpu).unwrap()
    };
    let forward = |p: &[Var], x: &Tensor, cut: &mut dyn FnMut(&Tensor) -> Tensor| {
        let mut h = x.clone();
        for l in 0..LAYERS {
            h = autograd_dist::grad_once::matmul(&h, p[2 * l].as_tensor()).unwrap();
            h = h
                .broadcast_add(p[2 * l + 1].as_tensor())
                .unwrap()
                .tanh()
                .unwrap();
            if l + 1 < LAYERS {
                h = cut(&h);
            }
        }
        h.sqr().unwrap().mean_all().unwrap()
    };
    // One process on both ranks' rows, two SGD steps.
    let one = params();
    let mut opt = Optimizer::new(OptimizerKind::sgd(LR), one.clone());
    let both = Tensor::cat(&[input(0), input(1)], 0).unwrap();
    for _ in 0..2 {
        opt.step(&forward(&one, &both, &mut |h| h.clone()).backward().unwrap())
            .unwrap();
    }
    let got = run(60, async {
        let a = group(2).await;
        let outs = futures::future::join_all(a.iter().map(|w| async move {
            let started = Arc::new(Mutex::new(Vec::new()));
            let ddp = DistributedDataParallel::new(collectives::world(w), params())
                .await
                .unwrap()
                .with_hook(Noting(Arc::clone(&started)));
            let mut opt = ddp.wrap(Optimizer::new(OptimizerKind::sgd(LR), ddp.vars().to_vec()));
            let x = input(w.rank() as usize);
            let mut buckets = Vec::new();
            for _ in 0..2 {
                started.lock().unwrap().clear();
                let mut pass = opt.pass();
                let l = forward(ddp.vars(), &x, &mut |h| pass.cut(h).unwrap());
                opt.backward_step(pass, &l).await.unwrap();
                buckets.push(started.lock().unwrap().len());
            }
            (buckets, ddp.vars().to_vec())
        }))
        .await;
        shutdown_all(&a).await;
        outs
    });
    for (rank, (buckets, p)) in got.iter().enumerate() {
        // The first pass, which learns the plan, combines in the parameters' order.
        assert_eq!(
            buckets[1],
            LAYERS + 1,
            "rank {rank}: buckets per pass {buckets:?}"
        );
        for (q, o) in p.iter().zip(&one) {
            let d = max_abs_diff(q.as_tensor(), o.as_tensor());
            assert!(d <= 1e-5, "rank {rank}: differs by {d}");
        }
    }
}

/// DDP-8: an f16 bucket whose sum leaves f16's range (65,504) is combined again in the
/// gradients' own type, on every member, after backward and in an overlapped pass alike: the
/// step gets the exact mean, not infinities. A bucket that fits keeps its f16 rounding.
#[test]
fn an_f16_bucket_that_overflows_is_combined_again_in_full_precision() {
    run(60, async {
        let a = group(2).await;
        let out = futures::future::join_all(a.iter().map(|w| async move {
            let r = w.rank() as f32;
            let mk = |v: &[f32]| Var::new(v, &candle_core::Device::Cpu).unwrap();
            // Two buckets: the first's mean is 110,000 (each member's half fits in f16,
            // their sum does not); the second's fits.
            let vars = vec![mk(&[0.0; 3]), mk(&[0.0; 2])];
            let ddp =
                DistributedDataParallel::with_bucket_bytes(collectives::world(w), vars.clone(), 12)
                    .await
                    .unwrap()
                    .with_hook(CompressHook::f16());
            let big = Tensor::new(
                &[1e5 + 2e4 * r, 1.0, -1e5 - 2e4 * r],
                &candle_core::Device::Cpu,
            );
            let small = Tensor::new(&[0.1f32 + r, 3.0], &candle_core::Device::Cpu);
            let mut g = std::collections::HashMap::new();
            g.insert(vars[0].as_tensor().id(), big.unwrap());
            g.insert(vars[1].as_tensor().id(), small.unwrap());
            ddp.reduce_gradients(&mut g).await.unwrap();
            let after = [0, 1].map(|i| g[&vars[i].as_tensor().id()].to_vec1::<f32>().unwrap());
            // The same gradients through an overlapped pass: loss = sum(v0 * big) + ...
            let opt = Optimizer::new(OptimizerKind::sgd(1.0), vars.clone());
            let mut opt = ddp.wrap(opt);
            let pass = opt.pass();
            let l = (vars[0].as_tensor()
                * Tensor::new(
                    &[1e5 + 2e4 * r, 1.0, -1e5 - 2e4 * r],
                    &candle_core::Device::Cpu,
                )
                .unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
            opt.backward_step(pass, &l).await.unwrap();
            let stepped = vars[0].as_tensor().to_vec1::<f32>().unwrap();
            (after, stepped)
        }))
        .await;
        shutdown_all(&a).await;
        for (rank, (after, stepped)) in out.iter().enumerate() {
            assert_eq!(
                after[0],
                [1.1e5, 1.0, -1.1e5],
                "rank {rank}: after backward"
            );
            let d = (after[1][0] - 0.6).abs();
            assert!(
                d > 0.0 && d < 1e-3,
                "rank {rank}: the bucket that fits: {:?}",
                after[1]
            );
            assert_eq!(
                stepped,
                &[-1.1e5, -1.0, 1.1e5],
                "rank {rank}: overlapped step"
            );
        }
    });
}

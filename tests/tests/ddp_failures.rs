//! An overlapped data-parallel pass that fails on one member (DDP-5): the others' passes fail
//! at once with its cause, naming it, rather than wait for its buckets until their timeout;
//! and the members stay in step for the next pass, or, with a hook of the user's own (how
//! many operations a bucket takes is unknown), refuse it.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor, Var};
use collectives::{CommHook, DistributedDataParallel, Pass, ProcessGroup, ReduceOp, Work};
use integration_tests::{run, shutdown_all};

mod ddp_model;
use ddp_model::{dataset, group, init_params, loss};

/// What each member's pass returned (its gradients, or its error as text), and how long the
/// slower one took.
type Outcome = (Vec<Result<Vec<Tensor>, String>>, Duration);

/// A forward pass: the pass (for its cuts), the parameters, the inputs and the targets.
type Model = fn(&mut Pass<'_>, &[Var], &Tensor, &Tensor) -> Tensor;

/// The shared model, cut where its segments end.
fn model(pass: &mut Pass<'_>, p: &[Var], x: &Tensor, y: &Tensor) -> Tensor {
    loss(p, x, y, |h| pass.cut(h).unwrap())
}

/// Two members run `passes` passes; in pass `odd`, rank 1 runs `other` instead of the model.
fn passes(n: usize, odd: usize, other: Model) -> Vec<Outcome> {
    run(90, async move {
        let a = group(2).await;
        let (x, y) = dataset();
        let ddps = futures::future::join_all(a.iter().map(|w| async move {
            let g = collectives::world(w);
            DistributedDataParallel::with_bucket_bytes(g, init_params(0.0), 200)
                .await
                .unwrap()
        }))
        .await;
        let pass = |r: usize, f: Model| {
            let (ddp, x, y) = (&ddps[r], x.clone(), y.clone());
            async move {
                let mut pass = ddp.pass();
                let l = f(&mut pass, ddp.vars(), &x, &y);
                let got = pass.backward(&l).await.map_err(|e| e.to_string())?;
                Ok(ddp
                    .vars()
                    .iter()
                    .filter_map(|v| got.get(v).cloned())
                    .collect())
            }
        };
        let mut out = Vec::new();
        for i in 0..n {
            let started = Instant::now();
            let theirs = if i == odd { other } else { model };
            let (r0, r1) = futures::join!(pass(0, model), pass(1, theirs));
            out.push((vec![r0, r1], started.elapsed()));
        }
        shutdown_all(&a).await;
        out
    })
}

/// Rank 1's error, and rank 0's: both name rank 1 and the cause, well before the RPC
/// timeout (20 s).
fn failed_on_rank_1(o: &Outcome, cause: &str) {
    let (outs, took) = o;
    assert!(*took < Duration::from_secs(10), "took {took:?}: {outs:?}");
    for out in outs {
        let e = out.as_ref().unwrap_err();
        assert!(e.contains("rank 1") && e.contains(cause), "{e}");
    }
}

/// Both members' passes worked and combined to the same gradients.
fn equal_on_both(o: &Outcome) {
    let got: Vec<_> = o.0.iter().map(|o| o.clone().unwrap()).collect();
    assert_eq!(got[0].len(), 7, "every parameter's gradient");
    for (g0, g1) in got[0].iter().zip(&got[1]) {
        let d = (g0 - g1).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f64>().unwrap(), 0.0);
    }
}

/// DDP-5, once the buckets are known: rank 1's second pass moves a parameter to an earlier
/// segment (DDP-2 refuses it) while rank 0's does not; rank 0's pass fails at once with rank
/// 1's cause, and the third pass, the model's own on both, combines as before (the members
/// stayed in step: equal gradients).
#[test]
fn a_pass_that_fails_on_one_member_fails_everywhere_and_the_next_one_works() {
    let moved: Model = |pass, p, x, y| {
        let bent = (x.matmul(p[0].as_tensor()).unwrap().sum_all().unwrap()
            * p[4].as_tensor().sum_all().unwrap())
        .unwrap();
        let h = pass.cut(&bent.broadcast_as((1, 1)).unwrap()).unwrap();
        let h = pass.cut(&h).unwrap();
        (h.sum_all().unwrap() + loss(p, x, y, |h| h.clone())).unwrap()
    };
    let out = passes(3, 1, moved);
    assert!(out[0].0.iter().all(Result::is_ok), "{:?}", out[0]);
    failed_on_rank_1(&out[1], "parameter 4 got a gradient in segment 0");
    equal_on_both(&out[2]);
}

/// DDP-5, in the first pass: rank 1's loss ignores a cut, so its pass fails before it has
/// learnt the buckets; rank 0's fails at once with rank 1's cause (the learning pass combines
/// in the parameters' order, so rank 1 knows which operations to fail), neither keeps a plan,
/// and the next two passes (learning, then learnt) combine on both.
#[test]
fn a_first_pass_that_fails_on_one_member_fails_everywhere_and_the_next_ones_work() {
    let ignores_a_cut: Model = |pass, p, x, _| {
        let h = x.matmul(p[0].as_tensor()).unwrap();
        let _ = pass.cut(&h).unwrap();
        let _ = pass.cut(&h).unwrap();
        h.sqr().unwrap().mean_all().unwrap()
    };
    let out = passes(3, 0, ignores_a_cut);
    failed_on_rank_1(&out[0], "the loss does not depend on cut");
    for o in &out[1..] {
        equal_on_both(o);
    }
}

/// A hook of the user's own: the all-reduce, through `reduce` (no fast path).
struct Plain;

impl CommHook for Plain {
    fn reduce(&self, group: &ProcessGroup, bucket: Tensor, op: ReduceOp) -> Work<Tensor> {
        group.all_reduce_async(&bucket, op)
    }

    fn name(&self) -> &'static str {
        "plain"
    }
}

/// DDP-5 after backward: rank 1 cannot make its first bucket (a gradient of the wrong type,
/// which the concatenation refuses); rank 0's `reduce_gradients` fails at once with rank 1's
/// cause, and, the hook being the user's (how many operations a bucket takes is unknown),
/// both refuse the next call.
#[test]
fn a_bucket_that_cannot_start_on_one_member_fails_everywhere() {
    let outs = run(60, async {
        let a = group(2).await;
        let (x, y) = dataset();
        let outs = futures::future::join_all(a.iter().map(|w| {
            let (x, y) = (x.clone(), y.clone());
            async move {
                let g = collectives::world(w);
                let ddp = DistributedDataParallel::with_bucket_bytes(g, init_params(0.0), 200)
                    .await
                    .unwrap()
                    .with_hook(Plain);
                let l = loss(ddp.vars(), &x, &y, |h| h.clone());
                let mut grads = autograd_dist::grad_once::backward(&l).unwrap();
                let mut again = autograd_dist::grad_once::backward(&l).unwrap();
                if w.rank() == 1 {
                    let last = ddp.vars().last().unwrap().as_tensor();
                    let wrong = last.ones_like().unwrap().to_dtype(DType::F32).unwrap();
                    grads.insert(last, wrong);
                }
                let started = Instant::now();
                let first = ddp.reduce_gradients(&mut grads).await.unwrap_err();
                let took = started.elapsed();
                let next = ddp.reduce_gradients(&mut again).await.unwrap_err();
                (first.to_string(), took, next.to_string())
            }
        }))
        .await;
        shutdown_all(&a).await;
        outs
    });
    for (first, took, next) in outs {
        assert!(took < Duration::from_secs(10), "took {took:?}: {first}");
        assert!(
            first.contains("rank 1") && first.contains("dtype"),
            "{first}"
        );
        assert!(next.contains("out of step"), "{next}");
    }
}

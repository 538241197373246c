//! An overlapped data-parallel pass that fails on one member (DDP-5): the others' passes fail
//! at once with its cause, naming it, rather than wait for its buckets until their timeout;
//! and the members stay in step for the next pass, or, with a hook of the user's own (how
//! many operations a bucket takes is unknown), refuse it.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use collectives::{CommHook, DistributedDataParallel, ProcessGroup, ReduceOp, Work};
use integration_tests::{run, shutdown_all};

mod ddp_model;
use ddp_model::{dataset, group, init_params, loss, model, moved, passes, Model, Outcome};

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
    // Every parameter's but the one the model never uses (DDP-9: it gets none).
    assert_eq!(got[0].len(), 6, "every used parameter's gradient");
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
    let out = passes(3, |i, r| if i == 1 && r == 1 { moved } else { model });
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
    let out = passes(3, |i, r| {
        if i == 0 && r == 1 {
            ignores_a_cut
        } else {
            model
        }
    });
    failed_on_rank_1(&out[0], "the loss does not depend on cut");
    for o in &out[1..] {
        equal_on_both(o);
    }
}

/// DDP-2's one plan: members whose first passes cut the model a different number of times
/// all fail that pass with one message (before, each learnt buckets of its own, which could
/// pair up with another's of the same length), and so does a later pass that cuts it another
/// number of times than the plan (rank 0's, failing rank 1's with its cause); the passes
/// between and after combine on both.
#[test]
fn passes_that_cut_the_model_differently_fail_on_every_member() {
    let doubled: Model = |pass, p, x, y| {
        loss(p, x, y, |h| {
            let h = pass.cut(h).unwrap();
            pass.cut(&h).unwrap()
        })
    };
    let out = passes(4, |i, r| match (i, r) {
        (0, 1) | (2, 0) => doubled,
        _ => model,
    });
    let first: Vec<String> = out[0].0.iter().map(|o| o.clone().unwrap_err()).collect();
    assert!(first[0].contains("cut the model differently"), "{first:?}");
    assert_eq!(first[0], first[1]);
    equal_on_both(&out[1]);
    let (outs, took) = &out[2];
    assert!(*took < Duration::from_secs(10), "took {took:?}: {outs:?}");
    for o in outs {
        let e = o.as_ref().unwrap_err();
        assert!(e.contains("rank 0") && e.contains("cuts the model"), "{e}");
    }
    equal_on_both(&out[3]);
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

/// Replicas whose models differ (a parameter's shape, how many there are) fail where they
/// are wrapped, on every member with one message naming the parameter and the ranks,
/// instead of a shape mismatch in some broadcast or at the first step (or, with one
/// parameter too many on a member, a wait there until the timeout while the others go on).
#[test]
fn replicas_whose_models_differ_fail_when_wrapped_naming_the_parameter() {
    let outs = run(60, async {
        let a = group(2).await;
        let mut outs = Vec::new();
        for case in 0..2 {
            let started = Instant::now();
            let errs = futures::future::join_all(a.iter().map(|w| async move {
                let mut p = init_params(0.0);
                if w.rank() == 1 {
                    if case == 0 {
                        let t = p[2].as_tensor().narrow(1, 0, 7).unwrap().contiguous();
                        p[2] = candle_core::Var::from_tensor(&t.unwrap()).unwrap();
                    } else {
                        p.pop();
                    }
                }
                let g = collectives::world(w);
                DistributedDataParallel::new(g, p)
                    .await
                    .unwrap_err()
                    .to_string()
            }))
            .await;
            outs.push((errs, started.elapsed()));
        }
        shutdown_all(&a).await;
        outs
    });
    let says = [
        "parameter 2 is a F64 tensor of shape [8, 8] on rank 0 and a F64 tensor of shape [8, 7] \
         on rank 1",
        "rank 0 has 7 parameters and rank 1 has 6",
    ];
    for ((errs, took), says) in outs.iter().zip(says) {
        assert!(*took < Duration::from_secs(10), "took {took:?}: {errs:?}");
        assert!(
            errs.iter().all(|e| e == &errs[0] && e.contains(says)),
            "{errs:#?}"
        );
    }
}

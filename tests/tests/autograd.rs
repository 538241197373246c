//! Distributed autograd across in-process workers (TCP and memory): gradients must equal the
//! single-process gradients of the same model and data (max abs difference <= 1e-6).

use std::time::Duration;

use autograd_dist::RTensor;
use candle_core::{DType, Device, IndexOp, Tensor, Var};
use integration_tests::autograd_fns::*;
use integration_tests::{each_transport, max_abs_diff, run, shutdown_all};
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

/// The one-process model of a chain of layers: `x @ W`, then ReLU where asked, layer by layer.
fn chain(x: &Tensor, layers: &[(&Var, bool)]) -> Tensor {
    layers.iter().fold(x.clone(), |h, (w, relu)| {
        let y = h.matmul(w.as_tensor()).unwrap();
        if *relu {
            y.relu().unwrap()
        } else {
            y
        }
    })
}

/// The mean square of [`chain`]'s output in this process, checked against the distributed
/// `loss` (within 1e-12), and its gradients.
fn local_mse(
    x: &Tensor,
    layers: &[(&Var, bool)],
    loss: &Tensor,
) -> candle_core::backprop::GradStore {
    let l = chain(x, layers).sqr().unwrap().mean_all().unwrap();
    assert!(max_abs_diff(&l, loss) < 1e-12);
    l.backward().unwrap()
}

/// Each `(worker, name, var)`: the gradient of parameter `name` on `worker` in context `ctx`
/// equals the one-process gradient of `var` in `g`, within 1e-6.
async fn assert_remote_grads(
    a: &Agent,
    ctx: u64,
    g: &candle_core::backprop::GradStore,
    params: &[(u32, &str, &Var)],
) {
    for &(worker, w, var) in params {
        let d = max_abs_diff(
            &remote_grad(a, worker, ctx, w).await,
            g.get(var.as_tensor()).unwrap(),
        );
        assert!(d <= 1e-6, "{w}: max abs diff {d}");
    }
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
        let g = local_mse(&x, &[(&w0, true), (&w1, true), (&w2, false)], &loss);
        let params = [(0u32, "m.w0", &w0), (1, "m.w1", &w1), (2, "m.w2", &w2)];
        assert_remote_grads(&a[0], ctx.id(), &g, &params).await;
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

/// PyTorch's `RRef.backward(context_id)`: the loss stays on the worker that computed it
/// (created there with `rref::remote` inside the context, from an activation another worker
/// made), and backward starts there: every worker's gradients equal one process's.
#[test]
fn backward_from_a_loss_that_lives_on_another_worker_matches_one_process() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        init(&a[0], 1, "r.w1", 4, 6).await;
        init(&a[0], 2, "r.w2", 6, 3).await;
        let x = input(5, 4);
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let h1 = a[0]
                    .rpc_async(1u32, linear, ("r.w1".into(), RTensor(x.clone()), true))
                    .await
                    .unwrap();
                rref::remote(&a[0], 2u32, make_activation, ("r.w2".into(), h1)).unwrap()
            })
            .await;
        ctx.backward_remote(&loss).await.unwrap();
        let (w1, w2) = (local("r.w1", 4, 6), local("r.w2", 6, 3));
        let l = chain(&x, &[(&w1, true), (&w2, false)]);
        assert!(max_abs_diff(&l, &loss.to_here().await.unwrap().0) < 1e-12);
        let g = l.sum_all().unwrap().backward().unwrap();
        let params = [(1u32, "r.w1", &w1), (2, "r.w2", &w2)];
        assert_remote_grads(&a[0], ctx.id(), &g, &params).await;
        drop(loss);
        ctx.release().await.unwrap();
        shutdown_all(&a).await;
    });
}

/// Remote modules: two stages built on workers 1 and 2 (`"worker1/cpu"`), driven from
/// worker 0 inside a context; the gradients on each worker equal one process's, an SGD step of
/// the `DistributedOptimizer` over their `remote_parameters` moves them as one process's SGD,
/// `state` reads the values back and `load_state` puts a saved state back (a wrong count or
/// shape refused, naming it, with nothing set). A bad place is refused naming it.
#[test]
fn remote_modules_train_like_one_process() {
    use autograd_dist::{DistributedOptimizer, OptimizerKind, RemoteModule};
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        let s1: RemoteModule<StageLinear> =
            RemoteModule::new(&a[0], "worker1/cpu", ("s.w1".into(), 4, 6, true))
                .await
                .unwrap();
        let s2: RemoteModule<StageLinear> =
            RemoteModule::new(&a[0], "worker2", ("s.w2".into(), 6, 3, false))
                .await
                .unwrap();
        assert_eq!(s2.owner_name(), "worker2");
        let x = input(5, 4);
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let h = s1.forward(x.clone()).await.unwrap();
                s2.forward(h)
                    .await
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .mean_all()
                    .unwrap()
            })
            .await;
        ctx.backward(std::slice::from_ref(&loss)).await.unwrap();
        let mut params = s1.remote_parameters().await.unwrap();
        params.extend(s2.remote_parameters().await.unwrap());
        let opt = DistributedOptimizer::new(&a[0], OptimizerKind::sgd(0.1), params).unwrap();
        opt.step(&ctx).await.unwrap();
        // One process.
        let (w1, w2) = (local("s.w1", 4, 6), local("s.w2", 6, 3));
        let g = local_mse(&x, &[(&w1, true), (&w2, false)], &loss);
        let mut sgd =
            autograd_dist::Optimizer::new(OptimizerKind::sgd(0.1), vec![w1.clone(), w2.clone()]);
        sgd.step(&g).unwrap();
        for (m, w) in [(&s1, &w1), (&s2, &w2)] {
            let state = m.state().await.unwrap();
            assert_eq!(state.len(), 1);
            let d = max_abs_diff(&state[0], w.as_tensor());
            assert!(d <= 1e-12, "after one SGD step: max abs diff {d}");
        }
        // A checkpoint restored: another value, refused states, then the saved one again.
        let saved = s2.state().await.unwrap();
        let other = saved[0].affine(2.0, 1.0).unwrap();
        s2.load_state(vec![other.clone()]).await.unwrap();
        assert!(max_abs_diff(&s2.state().await.unwrap()[0], &other) == 0.0);
        let e = rpc_core::error_chain(&s2.load_state(vec![]).await.unwrap_err());
        assert!(
            e.contains("worker2") && e.contains("0 tensors for 1 parameters"),
            "{e}"
        );
        let e = rpc_core::error_chain(&s2.load_state(vec![input(3, 6)]).await.unwrap_err());
        assert!(
            e.contains("parameter 0 is [6, 3]") && e.contains("[3, 6]"),
            "{e}"
        );
        s2.load_state(saved.clone()).await.unwrap();
        assert!(max_abs_diff(&s2.state().await.unwrap()[0], &saved[0]) == 0.0);
        let err = RemoteModule::<StageLinear>::new(&a[0], "worker1/gpu", ("e".into(), 1, 1, false))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("worker1/gpu"), "{err}");
        let err = RemoteModule::<StageLinear>::new(&a[0], "worker9/cpu", ("e".into(), 1, 1, false))
            .await
            .unwrap_err();
        assert!(rpc_core::error_chain(&err).contains("worker9"), "{err}");
        ctx.release().await.unwrap();
        drop((s1, s2, opt));
        shutdown_all(&a).await;
    });
}

/// AD-7, AD-8: the context a worker started is released on the others once that worker is
/// declared failed, and its replacement (the same rank, incarnation 1, its counter starting
/// over) opens contexts under other ids, so nothing the failed incarnation left on a worker
/// can be taken for the replacement's (a replaced pipeline master reusing its predecessor's
/// ids picked up stale hand-offs and gradients).
#[test]
fn a_replacement_never_reuses_the_context_ids_of_the_worker_it_replaced() {
    use integration_tests::elastic::ElasticGroup;
    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("not within 10 s: {what}");
    }
    each_transport(60, |t| async move {
        let g = ElasticGroup::start(3, t, registry, Duration::from_millis(600)).await;
        let a = &g.agents;
        init(&a[2], 0, "n.w", 3, 2).await;
        let x = || RTensor(input(2, 3));
        let old = autograd_dist::context(&a[2]);
        old.run(async {
            a[2].rpc_async(0u32, linear, ("n.w".into(), x(), false))
                .await
        })
        .await
        .unwrap();
        assert_eq!(autograd_dist::live_contexts(&a[0]), 1);
        rpc_core::testing::silence(&a[2], true);
        until("worker 2 declared failed", || !a[0].is_live(2u32).unwrap()).await;
        until("its context released on worker 0", || {
            autograd_dist::live_contexts(&a[0]) == 0
        })
        .await;
        let new = g.start_rank(2, true).await.expect("the replacement joins");
        let fresh = autograd_dist::context(&new);
        assert_eq!(fresh.id() >> 48, 2, "{:#x}", fresh.id());
        assert_eq!(
            fresh.id() & 0xffff_ffff,
            old.id() & 0xffff_ffff,
            "the counter started over"
        );
        assert_ne!(fresh.id(), old.id(), "the incarnation tells them apart");
        fresh
            .run(async {
                new.rpc_async(0u32, linear, ("n.w".into(), x(), false))
                    .await
            })
            .await
            .unwrap();
        assert_eq!(autograd_dist::live_contexts(&a[0]), 1);
        fresh.release().await.unwrap();
        assert_eq!(autograd_dist::live_contexts(&a[0]), 0);
        std::mem::forget(old); // its worker is fenced: nothing to release
        let reports = futures::future::join_all([&a[0], &a[1], &new].map(|x| x.shutdown())).await;
        for r in &reports {
            assert!(r.is_clean(), "{r:?}");
        }
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

/// A handler that makes its nested call from a task it spawned (`rpc_core::spawn`): the task
/// carries the autograd context, so the tensor it sends is recorded and the gradient of the
/// parameter on the far worker is right. (Spawned with a bare `tokio::spawn`, the send goes
/// unrecorded; backward returned `Ok` with no gradient for either weight, and now fails:
/// AD-10 and AD-11, below.)
#[test]
fn a_nested_call_from_a_spawned_task_is_recorded_in_the_context() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        init(&a[0], 1, "s.w1", 3, 4).await;
        init(&a[0], 2, "s.w2", 4, 2).await;
        let x = input(2, 3);
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let r = a[0]
                    .rpc_async(
                        1u32,
                        linear_then_spawned,
                        ("s.w1".into(), RTensor(x.clone()), 2, "s.w2".into()),
                    )
                    .await
                    .unwrap();
                r.0.sum_all().unwrap()
            })
            .await;
        ctx.backward(std::slice::from_ref(&loss)).await.unwrap();
        let (w1, w2) = (local("s.w1", 3, 4), local("s.w2", 4, 2));
        let r = (x
            .matmul(w1.as_tensor())
            .unwrap()
            .tanh()
            .unwrap()
            .matmul(w2.as_tensor())
            .unwrap()
            * 2.0)
            .unwrap();
        let g = r.sum_all().unwrap().backward().unwrap();
        for (worker, w, var) in [(1u32, "s.w1", &w1), (2, "s.w2", &w2)] {
            let got = a[0]
                .rpc_async(worker, param_grad, (ctx.id(), w.to_string()))
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{w} got no gradient"));
            let d = max_abs_diff(&got.0, g.get(var.as_tensor()).unwrap());
            assert!(d <= 1e-6, "{w}: max abs diff {d}");
        }
        ctx.release().await.unwrap();
        shutdown_all(&a).await;
    });
}

/// AD-10: the same handler with a bare `tokio::spawn`: the task's call carries no context,
/// so the tensor it sends, computed from one received in the context, would leave the graph
/// there; backward returned `Ok` and neither weight got a gradient, without a word. The call
/// now fails naming the context, the worker and the way out; a detached tensor (its value
/// alone, on purpose) is sent as before.
#[test]
fn a_tensor_of_a_context_sent_by_a_call_without_it_is_refused() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        init(&a[0], 1, "b.w1", 3, 4).await;
        init(&a[0], 2, "b.w2", 4, 2).await;
        // The input with a graph (a variable here), so that worker 1 receives it as a leaf.
        let xv = candle_core::Var::from_tensor(&input(2, 3)).unwrap();
        let x = xv.as_tensor().clone();
        let ctx = autograd_dist::context(&a[0]);
        let call = |detach: bool| {
            let args = ("b.w1".into(), RTensor(x.clone()), 2, "b.w2".into(), detach);
            ctx.run(async { a[0].rpc_async(1u32, linear_then_bare_spawned, args).await })
        };
        let err = call(false).await.expect_err("the cut graph is refused");
        let said = rpc_core::error_chain(&err);
        for part in [
            "carries no autograd context",
            "rpc_core::spawn",
            "detach",
            "worker2",
        ] {
            assert!(said.contains(part), "{part:?} in: {said}");
        }
        let out = call(true).await.expect("a detached tensor is sent");
        assert_eq!(out.0.dims(), &[2, 2]);
        ctx.release().await.unwrap();
        shutdown_all(&a).await;
    });
}

/// AD-11: backward from a root without a graph (it depends on no variable and on no tensor
/// received in the context) is refused, as PyTorch's `dist_autograd.backward` refuses a root
/// that does not require grad. The classic way to make one: a call made outside the context
/// and only awaited inside it, whose reply is then recorded nowhere; backward returned `Ok`
/// and no parameter anywhere got a gradient.
#[test]
fn backward_from_a_root_without_a_graph_is_refused() {
    run(60, async {
        let a = group(2, Transport::Memory(rpc_core::MemoryNetwork::new())).await;
        init(&a[0], 1, "r.w1", 3, 4).await;
        let xv = candle_core::Var::from_tensor(&input(2, 3)).unwrap();
        let ctx = autograd_dist::context(&a[0]);
        let made_outside = a[0].rpc_async(
            1u32,
            linear,
            ("r.w1".into(), RTensor(xv.as_tensor().clone()), false),
        );
        let y = ctx.run(made_outside).await.unwrap();
        let loss = y.0.sum_all().unwrap();
        let err = ctx
            .backward(std::slice::from_ref(&loss))
            .await
            .expect_err("refused");
        let said = err.to_string();
        assert!(
            said.contains("root 0") && said.contains("no graph"),
            "{said}"
        );
        // Made inside, the same call's reply is a root with a graph.
        let y = ctx
            .run(async {
                let args = ("r.w1".into(), RTensor(xv.as_tensor().clone()), false);
                a[0].rpc_async(1u32, linear, args).await
            })
            .await
            .unwrap();
        ctx.backward(&[y.0.sum_all().unwrap()]).await.unwrap();
        assert!(
            ctx.gradient(xv.as_tensor()).is_some(),
            "the input got its gradient"
        );
        ctx.release().await.unwrap();
        shutdown_all(&a).await;
    });
}

/// AD-9: a context whose state reached worker 2 only through worker 1 (master → worker 1 →
/// worker 2, a nested call), worker 1 then declared failed: the master's release succeeds
/// and worker 2's state goes (the release used to stop at the failed worker with an error,
/// leaving worker 2's state for good).
#[test]
fn a_context_reached_through_a_failed_worker_is_released() {
    run(60, async {
        let a = group(3, Transport::Memory(rpc_core::MemoryNetwork::new())).await;
        init(&a[0], 1, "f.w1", 3, 4).await;
        init(&a[0], 2, "f.w2", 4, 2).await;
        let ctx = autograd_dist::context(&a[0]);
        ctx.run(async {
            a[0].rpc_async(
                1u32,
                linear_then,
                ("f.w1".into(), RTensor(input(2, 3)), 2, "f.w2".into()),
            )
            .await
            .unwrap()
        })
        .await;
        assert_eq!(a[0].rpc_async(2u32, live_contexts, ()).await.unwrap(), 1);
        rpc_core::testing::silence(&a[1], true);
        let by = std::time::Instant::now() + Duration::from_secs(10);
        while a[0].is_live(1u32).unwrap() || a[2].is_live(1u32).unwrap() {
            assert!(std::time::Instant::now() < by, "worker 1 declared failed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ctx.release()
            .await
            .expect("released despite the failed worker");
        assert_eq!(
            a[0].rpc_async(2u32, live_contexts, ()).await.unwrap(),
            0,
            "released on worker 2"
        );
        for r in futures::future::join_all([&a[0], &a[2]].map(|a| a.shutdown())).await {
            assert_eq!(r.aborted, 0, "{r:?}");
        }
        a[1].shutdown_within(Duration::from_secs(1)).await;
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
    if autograd_dist::cuda_devices().is_ok_and(|n| n > 0) {
        eprintln!("skipped: this machine has a usable GPU (tests/gpu.rs covers it)");
        return;
    }
    let err = "cuda:0"
        .parse::<autograd_dist::DeviceSpec>()
        .unwrap()
        .device()
        .unwrap_err();
    assert!(err.to_string().contains("cuda:0"), "{err}");
}

#[test]
fn device_maps_are_validated_at_install_and_applied_to_requests() {
    if autograd_dist::cuda_devices().is_ok_and(|n| n > 0) {
        eprintln!("skipped: it relies on cuda:0 being unusable; this machine has a GPU");
        return;
    }
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

/// Counts the backward passes through it (an identity forward).
struct CountingIdentity;

static COUNTED_BACKWARDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl candle_core::CustomOp1 for CountingIdentity {
    fn name(&self) -> &'static str {
        "counting-identity"
    }
    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (a, b) = l.contiguous_offsets().expect("contiguous input");
        Ok((
            candle_core::CpuStorage::F64(s.as_slice::<f64>()?[a..b].to_vec()),
            l.shape().clone(),
        ))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        COUNTED_BACKWARDS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Some(grad.clone()))
    }
}

/// AD-6: a tensor whose halves feed two workers is backpropagated through once, with both
/// workers' gradients (the hybrid example's encoder), and the gradients are still exact.
#[test]
fn a_worker_feeding_two_workers_backpropagates_once_per_wave() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        init(&a[0], 0, "o.w0", 3, 4).await;
        init(&a[0], 1, "o.w1", 4, 2).await;
        init(&a[0], 2, "o.w2", 4, 2).await;
        let x = input(6, 3);
        let before = COUNTED_BACKWARDS.load(std::sync::atomic::Ordering::SeqCst);
        let w0 = a[0]
            .rpc_async(0u32, param_value, ("o.w0".to_string(),))
            .await
            .unwrap();
        let w0 = Var::from_tensor(&w0.0).unwrap();
        let ctx = autograd_dist::context(&a[0]);
        let loss = ctx
            .run(async {
                let h = x
                    .matmul(w0.as_tensor())
                    .unwrap()
                    .apply_op1(CountingIdentity)
                    .unwrap();
                let top = RTensor(h.narrow(0, 0, 3).unwrap());
                let bottom = RTensor(h.narrow(0, 3, 3).unwrap());
                let (p, q) = futures::join!(
                    a[0].rpc_async(1u32, linear, ("o.w1".into(), top, false)),
                    a[0].rpc_async(2u32, linear, ("o.w2".into(), bottom, false))
                );
                (p.unwrap().0.sqr().unwrap().sum_all().unwrap()
                    + q.unwrap().0.sqr().unwrap().sum_all().unwrap())
                .unwrap()
            })
            .await;
        tokio::time::timeout(Duration::from_secs(10), ctx.backward(&[loss]))
            .await
            .expect("no hang")
            .unwrap();
        let passes = COUNTED_BACKWARDS.load(std::sync::atomic::Ordering::SeqCst) - before;
        assert_eq!(
            passes, 1,
            "the shared tensor was backpropagated {passes} times"
        );

        let (l0, l1, l2) = (
            local("o.w0", 3, 4),
            local("o.w1", 4, 2),
            local("o.w2", 4, 2),
        );
        let h = x.matmul(l0.as_tensor()).unwrap();
        let p = h.narrow(0, 0, 3).unwrap().matmul(l1.as_tensor()).unwrap();
        let q = h.narrow(0, 3, 3).unwrap().matmul(l2.as_tensor()).unwrap();
        let g = (p.sqr().unwrap().sum_all().unwrap() + q.sqr().unwrap().sum_all().unwrap())
            .unwrap()
            .backward()
            .unwrap();
        let d0 = max_abs_diff(
            &ctx.gradient(w0.as_tensor()).unwrap(),
            g.get(l0.as_tensor()).unwrap(),
        );
        assert!(d0 <= 1e-6, "w0: {d0}");
        for (worker, w, var) in [(1u32, "o.w1", &l1), (2, "o.w2", &l2)] {
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

/// One training step of `x → relu(x @ s.w1) @ s.w2` on workers 1 and 2.
async fn opt_step(a0: &Agent, opt: &autograd_dist::DistributedOptimizer, x: &Tensor) {
    let ctx = autograd_dist::context(a0);
    let loss = ctx
        .run(async {
            let h = a0
                .rpc_async(1u32, linear, ("s.w1".into(), RTensor(x.clone()), true))
                .await
                .unwrap();
            let y = a0
                .rpc_async(2u32, linear, ("s.w2".into(), h, false))
                .await
                .unwrap();
            y.0.sqr().unwrap().sum_all().unwrap()
        })
        .await;
    ctx.backward(&[loss]).await.unwrap();
    opt.step(&ctx).await.unwrap();
    ctx.release().await.unwrap();
}

/// `DistributedOptimizer`: a saved state restored onto the same parameter values reproduces the
/// next step bit for bit; a state of the wrong size is refused; a zero learning rate freezes
/// the parameters.
#[test]
fn distributed_optimizer_state_round_trips_and_learning_rate_changes() {
    each_transport(60, |t| async move {
        use autograd_dist::{DistributedOptimizer, OptimizerKind};
        let a = group(3, t).await;
        init(&a[0], 1, "s.w1", 3, 4).await;
        init(&a[0], 2, "s.w2", 4, 2).await;
        let mut params = a[0]
            .rpc_async(1u32, param_refs, (vec!["s.w1".to_string()],))
            .await
            .unwrap();
        params.extend(
            a[0].rpc_async(2u32, param_refs, (vec!["s.w2".to_string()],))
                .await
                .unwrap(),
        );
        // A rate out of range is refused where the optimizer is made, before any owner's.
        let bad = DistributedOptimizer::new(&a[0], OptimizerKind::adam(-0.05), params.clone());
        let e = bad.expect_err("a negative learning rate").to_string();
        assert!(e.contains("learning rate -0.05"), "{e}");
        let opt = DistributedOptimizer::new(&a[0], OptimizerKind::adam(0.05), params).unwrap();
        let x = input(5, 3);
        let values = || async {
            let v1 = a[0]
                .rpc_async(1u32, param_value, ("s.w1".to_string(),))
                .await
                .unwrap();
            let v2 = a[0]
                .rpc_async(2u32, param_value, ("s.w2".to_string(),))
                .await
                .unwrap();
            (
                v1.0.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
                v2.0.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            )
        };
        opt_step(&a[0], &opt, &x).await;
        opt_step(&a[0], &opt, &x).await;
        let saved = opt.state().await.unwrap();
        assert_eq!(saved.len(), 2);
        assert!(saved
            .iter()
            .all(|s| s.steps == 2 && s.m[0].is_some() && s.v[0].is_some()));
        let snapshot = values().await;
        opt_step(&a[0], &opt, &x).await;
        let after = values().await;
        assert_ne!(after, snapshot, "a step moves the parameters");

        // Back to the snapshot: values and optimizer state.
        for (w, worker, v, shape) in [
            ("s.w1", 1u32, &snapshot.0, (3, 4)),
            ("s.w2", 2, &snapshot.1, (4, 2)),
        ] {
            let t = Tensor::from_vec(v.clone(), shape, &Device::Cpu).unwrap();
            a[0].rpc_async(worker, set_param, (w.to_string(), RTensor(t)))
                .await
                .unwrap();
        }
        opt.load_state(saved.clone()).await.unwrap();
        opt_step(&a[0], &opt, &x).await;
        assert_eq!(
            values().await,
            after,
            "the restored state reproduces the step bit for bit"
        );

        let err = opt.load_state(saved[..1].to_vec()).await.unwrap_err();
        assert!(err.to_string().contains("1 states for 2 owners"), "{err}");
        let mut wrong = saved.clone();
        wrong[0].m.push(None);
        wrong[0].v.push(None);
        let err = opt.load_state(wrong).await.unwrap_err();
        assert!(err.to_string().contains("worker1"), "{err}");

        opt.set_lr(0.0).await.unwrap();
        let frozen = values().await;
        opt_step(&a[0], &opt, &x).await;
        assert_eq!(
            values().await,
            frozen,
            "learning rate 0 leaves the parameters alone"
        );
        assert!(opt.set_lr(f64::NAN).await.is_err());
        shutdown_all(&a).await;
    });
}

/// Three stages (the last two on one worker) of a pipeline, built from `prefix`.
async fn linear_stages(
    a: &Agent,
    prefix: &str,
    widths: [usize; 4],
) -> Vec<autograd_dist::RemoteModule<StageLinear>> {
    let places = ["worker1/cpu", "worker2/cpu", "worker2"];
    let mut stages = Vec::new();
    for (i, place) in places.iter().enumerate() {
        let init = (format!("{prefix}.w{i}"), widths[i], widths[i + 1], i < 2);
        stages.push(
            autograd_dist::RemoteModule::new(a, place, init)
                .await
                .unwrap(),
        );
    }
    stages
}

#[test]
fn pipelines_train_like_one_process_for_both_schedules_and_any_micro_batch_count() {
    use autograd_dist::{
        Action, DistributedOptimizer, Loss, Optimizer, OptimizerKind, Pipeline, Schedule,
    };
    each_transport(120, |t| async move {
        let a = group(3, t).await;
        let widths = [4, 6, 5, 3];
        let (rows, steps) = (8, 20);
        let x = input(rows, widths[0]);
        let labels: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + 1) % 3).collect();
        let y = Tensor::new(labels.as_slice(), &Device::Cpu).unwrap();
        // One process, on the whole batch.
        let ws: Vec<Var> = (0..3)
            .map(|i| local(&format!("p.w{i}"), widths[i], widths[i + 1]))
            .collect();
        let model = |ws: &[Var]| chain(&x, &[(&ws[0], true), (&ws[1], true), (&ws[2], false)]);
        let mut sgd = Optimizer::new(OptimizerKind::sgd(0.5), ws.clone());
        let mut one = Vec::new(); // (loss, parameters) after each step
        for _ in 0..steps {
            let loss = Loss::CrossEntropy.compute(&model(&ws), &y, rows).unwrap();
            sgd.step(&loss.backward().unwrap()).unwrap();
            let l = loss.to_scalar::<f64>().unwrap();
            one.push((
                l,
                ws.iter()
                    .map(|w| w.as_tensor().copy().unwrap())
                    .collect::<Vec<_>>(),
            ));
        }
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for m in [1, 2, 4, 8] {
                let modules = linear_stages(&a[0], "p", widths).await;
                let stages = modules.iter().cloned().map(Into::into).collect();
                let pipe = Pipeline::new(&a[0], stages, m, schedule, Loss::CrossEntropy).unwrap();
                assert_eq!(pipe.workers(), ["worker1", "worker2", "worker2"]);
                let params = pipe.remote_parameters().await.unwrap();
                let opt =
                    DistributedOptimizer::new(&a[0], OptimizerKind::sgd(0.5), params).unwrap();
                let mut worst = 0f64;
                for (k, (loss, want)) in one.iter().enumerate() {
                    let ctx = autograd_dist::context(&a[0]);
                    let report = pipe.step(&ctx, &x, &y).await.unwrap();
                    assert!(
                        (report.loss - loss).abs() < 1e-12,
                        "{schedule} m={m} step {k}"
                    );
                    assert_eq!(opt.step(&ctx).await.unwrap(), 3);
                    ctx.release().await.unwrap();
                    // Every pass ran once, in the schedule's order on each stage.
                    assert_eq!(report.events.len(), 2 * 3 * m);
                    for s in 0..3 {
                        let done: Vec<Action> = report
                            .events
                            .iter()
                            .filter(|e| e.stage == s)
                            .map(|e| e.action)
                            .collect();
                        assert_eq!(done, schedule.actions(s, 3, m), "{schedule} m={m}");
                    }
                    // GPipe keeps every micro-batch; 1F1B at most p - s on stage s.
                    let bound: Vec<usize> = (0..3)
                        .map(|s| match schedule {
                            Schedule::GPipe => m,
                            Schedule::OneFOneB => (3 - s).min(m),
                        })
                        .collect();
                    assert_eq!(report.max_live_activations, bound, "{schedule} m={m}");
                    let bubble = report.bubble();
                    assert!((0.0..1.0).contains(&bubble), "{bubble}");
                    for (module, w) in modules.iter().zip(want) {
                        let got = module.state().await.unwrap().remove(0);
                        worst = worst.max(max_abs_diff(&got, w));
                    }
                }
                assert!(worst <= 1e-10, "{schedule} m={m}: max abs diff {worst}");
                drop((pipe, opt, modules));
            }
        }
        assert_eq!(autograd_dist::live_contexts(&a[1]), 0);
        assert_eq!(autograd_dist::live_contexts(&a[2]), 0);
        shutdown_all(&a).await;
    });
}

/// `Config::with_rpc_timeout(Duration::ZERO)` means no timeout: a stage waited for its
/// neighbour's activation "within 0ns" and failed the step whenever it had not arrived yet.
#[test]
fn a_pipeline_runs_without_a_call_timeout() {
    use autograd_dist::{Loss, Pipeline, Schedule};
    run(60, async {
        let a = start_group(
            3,
            Transport::Tcp,
            Secret::generate(),
            |_| registry(),
            |_, c| c.with_rpc_timeout(Duration::ZERO),
        )
        .await
        .expect("group starts");
        let (rows, widths) = (8, [4, 6, 5, 3]);
        let x = input(rows, widths[0]);
        let labels: Vec<u32> = (0..rows as u32).map(|i| i % 3).collect();
        let y = Tensor::new(labels.as_slice(), &Device::Cpu).unwrap();
        let modules = linear_stages(&a[0], "z", widths).await;
        let stages = modules.iter().cloned().map(Into::into).collect();
        let pipe = Pipeline::new(&a[0], stages, 4, Schedule::GPipe, Loss::CrossEntropy).unwrap();
        for step in 0..3 {
            let ctx = autograd_dist::context(&a[0]);
            let report = pipe.step(&ctx, &x, &y).await;
            let report = report.unwrap_or_else(|e| panic!("step {step}: {e}"));
            assert!(report.loss.is_finite());
            ctx.release().await.unwrap();
        }
        drop((pipe, modules));
        shutdown_all(&a).await;
    });
}

/// Cross-entropy's targets are class indices: floats were cast to u32 on the last stage, so
/// a label of -1 (an "ignore" marker) became class 0 and 2.7 became 2, and the step trained
/// on them without a word. They are refused before the step starts, as PyTorch refuses them.
#[test]
fn class_targets_of_a_float_type_are_refused() {
    use autograd_dist::{Loss, Pipeline, Schedule};
    run(60, async {
        let a = group(3, Transport::Memory(rpc_core::MemoryNetwork::new())).await;
        let modules = linear_stages(&a[0], "c", [4, 6, 5, 3]).await;
        let stages = modules.iter().cloned().map(Into::into).collect();
        let pipe = Pipeline::new(&a[0], stages, 2, Schedule::GPipe, Loss::CrossEntropy).unwrap();
        let x = input(4, 4);
        let y = Tensor::new(&[-1f32, 0., 1., 2.7], &Device::Cpu).unwrap();
        let ctx = autograd_dist::context(&a[0]);
        let e = pipe.step(&ctx, &x, &y).await.expect_err("float targets");
        assert!(e.to_string().contains("class indices"), "{e}");
        let local = Loss::CrossEntropy.compute(&input(4, 3), &y, 4);
        let e = local.expect_err("float targets, in one process");
        assert!(e.to_string().contains("class indices"), "{e}");
        ctx.release().await.unwrap();
        drop((pipe, modules));
        shutdown_all(&a).await;
    });
}

#[test]
fn a_failing_pipeline_stage_fails_the_step_naming_it_and_the_others_stop() {
    use autograd_dist::{AutogradError, Loss, Pipeline, Schedule};
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        // Stage 1 expects 7 columns where stage 0 gives 6: its first forward fails.
        let modules = linear_stages(&a[0], "f", [4, 7, 5, 3]).await;
        let mut stages: Vec<autograd_dist::Stage> =
            modules.iter().cloned().map(Into::into).collect();
        let first: autograd_dist::RemoteModule<StageLinear> =
            autograd_dist::RemoteModule::new(&a[0], "worker1", ("f.bad".into(), 4, 6, true))
                .await
                .unwrap();
        stages[0] = first.into();
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let pipe =
                Pipeline::new(&a[0], stages.clone(), 4, schedule, Loss::CrossEntropy).unwrap();
            let ctx = autograd_dist::context(&a[0]);
            let y = Tensor::new(&[0u32, 1, 2, 0], &Device::Cpu).unwrap();
            let err = pipe.step(&ctx, &input(4, 4), &y).await.unwrap_err();
            match &err {
                AutogradError::Stage { stage, worker, .. } => {
                    assert_eq!((*stage, worker.as_str()), (1, "worker2"))
                }
                other => panic!("{other}"),
            }
            let text = rpc_core::error_chain(&err);
            assert!(text.contains("stage 1 on worker `worker2`"), "{text}");
            assert!(text.contains("forward of micro-batch 0"), "{text}");
            assert!(text.contains("shape mismatch"), "{text}");
            ctx.release().await.unwrap();
        }
        // A batch smaller than the micro-batch count is refused before anything runs.
        let pipe = Pipeline::new(&a[0], stages, 4, Schedule::GPipe, Loss::CrossEntropy).unwrap();
        let ctx = autograd_dist::context(&a[0]);
        let y = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
        let err = pipe.step(&ctx, &input(2, 4), &y).await.unwrap_err();
        assert!(err.to_string().contains("2 rows"), "{err}");
        drop((pipe, modules));
        shutdown_all(&a).await;
    });
}

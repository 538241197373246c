//! EL-1, EL-2: data parallelism that loses a member. Four ranks train with `ElasticDdp` on a
//! global batch of 12, committing every 3 steps; rank 3 freezes (its heartbeats stop) at step
//! 7. The three survivors' next all-reduce fails naming it, they roll back to the commit, re-form
//! the ring without it, re-partition the data over three, and finish: their parameters are
//! identical and equal to one process training on the whole global batch throughout.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use collectives::{CommHook, DistributedSampler, ElasticDdp, ProcessGroup, ReduceOp, Work};
use integration_tests::{max_abs_diff, run};
use rpc_core::testing::{self, start_group};
use rpc_core::{Secret, Transport};

const N: usize = 48;
const B: usize = 12;
const STEPS: u64 = 16;
const COMMIT_EVERY: u64 = 3;
const FREEZE_AT: u64 = 7;
const SEED: u64 = 5;

fn dataset() -> (Tensor, Tensor) {
    let x: Vec<f64> = (0..N * 4)
        .map(|i| ((i * 37 % 23) as f64 / 23.0) - 0.5)
        .collect();
    let x = Tensor::from_vec(x, (N, 4), &Device::Cpu).unwrap();
    let w = Tensor::new(
        &[[1.0f64, -2.0], [0.5, 0.3], [-1.0, 1.5], [2.0, 0.1]],
        &Device::Cpu,
    )
    .unwrap();
    let y = x.matmul(&w).unwrap().sin().unwrap();
    (x, y)
}

fn init(offset: f64) -> Vec<Var> {
    let mk = |r: usize, c: usize, salt: usize| {
        let v: Vec<f64> = (0..r * c)
            .map(|i| (((i * 31 + salt) % 17) as f64 / 17.0 - 0.5) * 0.5 + offset)
            .collect();
        Var::from_tensor(&Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()).unwrap()
    };
    vec![mk(4, 8, 1), mk(8, 2, 2)]
}

fn loss(p: &[Var], x: &Tensor, y: &Tensor, idx: &[usize]) -> Tensor {
    let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let (x, y) = (
        x.index_select(&ids, 0).unwrap(),
        y.index_select(&ids, 0).unwrap(),
    );
    let h = x.matmul(p[0].as_tensor()).unwrap().tanh().unwrap();
    (h.matmul(p[1].as_tensor()).unwrap() - y)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
}

/// `n` workers over TCP whose failure detector declares a silent one failed within 600 ms.
async fn group(n: u32) -> Vec<rpc_core::Agent> {
    start_group(
        n,
        Transport::Tcp,
        Secret::generate(),
        |_| {
            collectives::install(rpc_core::Registry::builder())
                .unwrap()
                .build()
        },
        |_, c| {
            c.with_heartbeat_interval(Duration::from_millis(100))
                .with_failure_timeout(Duration::from_millis(600))
                .with_shutdown_timeout(Duration::from_secs(5))
        },
    )
    .await
    .expect("group starts")
}

/// Step `step`'s part of the global batch for replica `i` of `r`.
fn batch(step: u64, i: usize, r: usize) -> Vec<usize> {
    let per_epoch = (N / B) as u64;
    let (epoch, k) = (step / per_epoch, (step % per_epoch) as usize);
    let b = B / r;
    DistributedSampler::new(N, r, i, SEED).indices(epoch)[k * b..(k + 1) * b].to_vec()
}

/// A hook that counts the buckets it combines (with the plain all-reduce).
struct Counting(Arc<AtomicUsize>);

impl CommHook for Counting {
    fn reduce(&self, group: &ProcessGroup, bucket: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.0.fetch_add(1, Ordering::Relaxed);
        group.all_reduce_async(&bucket, op)
    }

    fn name(&self) -> &'static str {
        "counting"
    }
}

#[test]
fn survivors_reform_the_ring_and_track_one_process() {
    let (x, y) = dataset();
    let reference = init(0.0);
    let mut sgd = candle_nn::SGD::new(reference.clone(), 0.2).unwrap();
    for step in 0..STEPS {
        let l = loss(&reference, &x, &y, &batch(step, 0, 1));
        sgd.step(&l.backward().unwrap()).unwrap();
    }
    run(120, async move {
        let a = group(4).await;
        let finals = futures::future::join_all(a.iter().map(|w| {
            let (x, y) = (x.clone(), y.clone());
            async move {
                let r = w.rank();
                let world = collectives::world(w).with_ring_threads(3);
                let calls = Arc::new(AtomicUsize::new(0));
                let mut el = ElasticDdp::new(world, init(f64::from(r) * 0.3))
                    .await
                    .unwrap()
                    .with_hook(Counting(Arc::clone(&calls)))
                    .with_bucket_bytes(1); // a bucket per parameter: two a step
                let mut sgd = candle_nn::SGD::new(el.ddp().vars().to_vec(), 0.2).unwrap();
                let (mut step, mut failures) = (0, 0);
                while step < STEPS {
                    if r == 3 && step == FREEZE_AT {
                        testing::silence(w, true); // frozen: heartbeats stop, no more steps
                        return None;
                    }
                    if step % COMMIT_EVERY == 0 {
                        el.commit(step).unwrap();
                    }
                    let (i, n) = el.replica();
                    let mut g = loss(el.ddp().vars(), &x, &y, &batch(step, i, n))
                        .backward()
                        .unwrap();
                    match el.ddp().reduce_gradients(&mut g).await {
                        Ok(()) => {
                            sgd.step(&g).unwrap();
                            step += 1;
                        }
                        Err(e) => {
                            let why = rpc_core::error_chain(&e);
                            assert!(why.contains("worker3"), "rank {r} at step {step}: {why}");
                            failures += 1;
                            assert!(failures <= 3, "rank {r}: recovering again and again: {why}");
                            step = el.recover(Duration::from_secs(10)).await.unwrap();
                            assert!(step <= FREEZE_AT && step % COMMIT_EVERY == 0, "{step}");
                        }
                    }
                }
                assert_eq!(el.reforms(), 1, "rank {r}");
                // The re-formed group keeps the caller's settings: its ring threads, and the
                // hook and bucket size: the hook combined both buckets of every step that
                // completed (17: 7 before the freeze, 10 redone from the commit at 6), before
                // the re-form and after it (with 25 MiB buckets after it: 24 and the few
                // failed attempts).
                assert_eq!(el.group().ring_threads(), 3, "rank {r}");
                let calls = calls.load(Ordering::Relaxed) as u64;
                assert!(calls >= 2 * STEPS, "rank {r}: {calls} buckets");
                assert_eq!(el.group().ranks(), [0, 1, 2]);
                Some(
                    el.ddp()
                        .vars()
                        .iter()
                        .map(|v| v.as_tensor().clone())
                        .collect::<Vec<_>>(),
                )
            }
        }))
        .await;
        assert!(finals[3].is_none());
        for (rank, params) in finals.iter().take(3).enumerate() {
            let params = params.as_ref().unwrap();
            for (p, q) in params.iter().zip(&reference) {
                let d = max_abs_diff(p, q.as_tensor());
                assert!(d <= 1e-9, "rank {rank} differs from one process by {d}");
            }
            for (p, q) in params.iter().zip(finals[0].as_ref().unwrap()) {
                assert_eq!(
                    max_abs_diff(p, q),
                    0.0,
                    "rank {rank}'s replica differs from rank 0's"
                );
            }
        }
        assert!(
            max_abs_diff(reference[1].as_tensor(), init(0.0)[1].as_tensor()) > 1e-3,
            "trained"
        );
        let _ = tokio::join!(a[0].shutdown(), a[1].shutdown(), a[2].shutdown());
        let _ = a[3].shutdown_within(Duration::from_millis(500)).await;
    });
}

/// EL-1 when the survivors' commits differ: a member killed in the middle of an all-reduce can
/// let one survivor complete the step (all its chunks had arrived) while another fails it, and
/// the first may reach its next commit before it fails too. Recovery must give every survivor
/// one state that the group computed, the newest commit's, with its step; it took the
/// element-wise maximum of both commits' parameters (a state nobody computed) and each
/// survivor went on from its own step.
#[test]
fn survivors_whose_commits_differ_go_on_from_the_newest() {
    run(60, async {
        let a = group(3).await;
        // Rank 0 committed step 6 (it completed step 5); rank 1 last committed step 3, with
        // other values (larger in one parameter, smaller in the other).
        let newest = init(0.25);
        let older = [init(0.5)[0].clone(), init(-0.5)[1].clone()];
        let outs = futures::future::join_all(a.iter().map(|w| {
            let (newest, older) = (newest.clone(), older.clone());
            async move {
                let r = w.rank();
                let mut el = ElasticDdp::new(collectives::world(w), init(0.0))
                    .await
                    .unwrap();
                if r == 2 {
                    testing::silence(w, true);
                    return None;
                }
                let (values, step): (&[Var], u64) = if r == 0 { (&newest, 6) } else { (&older, 3) };
                for (v, t) in el.ddp().vars().iter().zip(values) {
                    v.set(t.as_tensor()).unwrap();
                }
                el.commit(step).unwrap();
                let step = el.recover(Duration::from_secs(10)).await.unwrap();
                let params: Vec<Tensor> = el
                    .ddp()
                    .vars()
                    .iter()
                    .map(|v| v.as_tensor().clone())
                    .collect();
                Some((step, el.committed_step(), params))
            }
        }))
        .await;
        for (rank, out) in outs.iter().take(2).enumerate() {
            let (step, committed, params) = out.as_ref().unwrap();
            assert_eq!((*step, *committed), (6, 6), "rank {rank}");
            for (p, q) in params.iter().zip(&newest) {
                assert_eq!(max_abs_diff(p, q.as_tensor()), 0.0, "rank {rank}");
            }
        }
        let _ = tokio::join!(a[0].shutdown(), a[1].shutdown());
        let _ = a[2].shutdown_within(Duration::from_millis(500)).await;
    });
}

//! `reduce`, `gather`, `scatter` and `all_to_all` against a one-process reference, with 2, 3
//! and 4 ranks and uneven sizes; their async variants; a member failing in the middle of each;
//! and COL-1's one verdict: whichever members find a mismatch, every member fails with the
//! same message.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use collectives::{ProcessGroup, ReduceOp};
use integration_tests::{run, shutdown_all};
use rpc_core::testing::start_group;
use rpc_core::{Agent, MemoryNetwork, Registry, Secret, Transport};

async fn group(n: u32) -> Vec<Agent> {
    integration_tests::collective_group(n, Transport::Memory(MemoryNetwork::new())).await
}

/// Rank `r`'s input: distinct per rank, nonzero (products stay finite and exact enough).
fn input(r: u32, len: usize) -> Tensor {
    let v: Vec<f32> = (0..len)
        .map(|i| 1.0 + ((i * 7 + r as usize * 13) % 5) as f32 * 0.25)
        .collect();
    Tensor::from_vec(v, len, &Device::Cpu).unwrap()
}

fn v(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// What `op` makes of every rank's input, in one process.
fn reference(n: u32, len: usize, op: ReduceOp) -> Vec<f32> {
    let all: Vec<Vec<f32>> = (0..n).map(|r| v(&input(r, len))).collect();
    (0..len)
        .map(|i| {
            let xs = all.iter().map(|a| a[i]);
            match op {
                ReduceOp::Sum => xs.sum(),
                ReduceOp::Mean => xs.sum::<f32>() / n as f32,
                ReduceOp::Max => xs.fold(f32::MIN, f32::max),
                ReduceOp::Min => xs.fold(f32::MAX, f32::min),
                ReduceOp::Product => xs.product(),
                _ => unreachable!(),
            }
        })
        .collect()
}

/// Runs `f` on every member's world group at once.
async fn on_all<T, F, Fut>(a: &[Agent], f: F) -> Vec<T>
where
    F: Fn(ProcessGroup, u32) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    futures::future::join_all(a.iter().map(|w| f(collectives::world(w), w.rank()))).await
}

/// A part from rank `from` to rank `to`: `from + to + 1` rows of 3, values naming both.
fn part(from: u32, to: u32) -> Tensor {
    let rows = (from + to + 1) as usize;
    let vals: Vec<f32> = (0..rows * 3)
        .map(|i| (from * 100 + to * 10) as f32 + i as f32)
        .collect();
    Tensor::from_vec(vals, (rows, 3), &Device::Cpu).unwrap()
}

#[test]
fn rooted_collectives_and_all_to_all_match_one_process() {
    run(120, async {
        for n in [2u32, 3, 4] {
            let a = group(n).await;
            let len = 11; // chunks of uneven sizes for every n here
            let root = n - 1;
            for op in [
                ReduceOp::Sum,
                ReduceOp::Mean,
                ReduceOp::Max,
                ReduceOp::Min,
                ReduceOp::Product,
            ] {
                let outs = on_all(&a, |g, r| async move {
                    g.reduce(&input(r, len), op, root).await.unwrap()
                })
                .await;
                for (r, o) in outs.iter().enumerate() {
                    match o {
                        Some(t) => {
                            assert_eq!(r as u32, root, "only the root gets the result");
                            let (got, want) = (v(t), reference(n, len, op));
                            for (x, y) in got.iter().zip(&want) {
                                assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{op:?} n={n}");
                            }
                        }
                        None => assert_ne!(r as u32, root),
                    }
                }
            }
            // gather to rank 1 (rank 0 when alone... n >= 2 here).
            let outs = on_all(&a, |g, r| async move {
                g.gather(&input(r, len), 1).await.unwrap()
            })
            .await;
            let gathered = outs[1].as_ref().expect("the root's");
            assert!(outs
                .iter()
                .enumerate()
                .all(|(r, o)| o.is_some() == (r == 1)));
            for (r, t) in gathered.iter().enumerate() {
                assert_eq!(v(t), v(&input(r as u32, len)));
            }
            // scatter from rank 0, parts of different lengths.
            let outs = on_all(&a, |g, r| async move {
                let parts =
                    (r == 0).then(|| (0..n).map(|j| input(j + 7, j as usize + 2)).collect());
                g.scatter(parts, 0).await.unwrap()
            })
            .await;
            for (r, t) in outs.iter().enumerate() {
                assert_eq!(v(t), v(&input(r as u32 + 7, r + 2)));
            }
            // all-to-all with unequal splits: rank j gets part(i, j) from every rank i.
            let outs = on_all(&a, |g, r| async move {
                let parts = (0..n).map(|j| part(r, j)).collect();
                g.all_to_all(parts).await.unwrap()
            })
            .await;
            for (j, got) in outs.iter().enumerate() {
                assert_eq!(got.len(), n as usize);
                for (i, t) in got.iter().enumerate() {
                    assert_eq!(v(t), v(&part(i as u32, j as u32)), "rank {j} from {i}");
                }
            }
            // all_to_all_single with equal splits: row blocks transposed across ranks.
            let outs = on_all(&a, |g, r| async move {
                let rows: Vec<f32> = (0..n * 2).map(|k| (r * 100 + k) as f32).collect();
                let t = Tensor::from_vec(rows, (n as usize * 2, 1), &Device::Cpu).unwrap();
                g.all_to_all_single(&t, None).await.unwrap()
            })
            .await;
            for (j, t) in outs.iter().enumerate() {
                let want: Vec<f32> = (0..n)
                    .flat_map(|i| [0, 1].map(|k| (i * 100 + j as u32 * 2 + k) as f32))
                    .collect();
                assert_eq!(v(t), want, "rank {j}");
            }
            shutdown_all(&a).await;
        }
    });
}

/// The async variants take their sequence numbers in call order, so several in flight pair
/// up across members whatever order their tasks run in.
#[test]
fn async_variants_pair_in_call_order() {
    run(60, async {
        let a = group(3).await;
        let outs = on_all(&a, |g, r| async move {
            let red = g.reduce_async(&input(r, 5), ReduceOp::Sum, 2);
            let gat = g.gather_async(&input(r, 4), 0);
            let parts = (r == 1).then(|| (0..3).map(|j| input(j, 3)).collect());
            let sca = g.scatter_async(parts, 1);
            let a2a = g.all_to_all_async((0..3).map(|j| part(r, j)).collect());
            (
                red.wait().await.unwrap(),
                gat.wait().await.unwrap(),
                sca.wait().await.unwrap(),
                a2a.wait().await.unwrap(),
            )
        })
        .await;
        assert_eq!(
            v(outs[2].0.as_ref().unwrap()),
            reference(3, 5, ReduceOp::Sum)
        );
        assert_eq!(outs[0].1.as_ref().unwrap().len(), 3);
        for (r, o) in outs.iter().enumerate() {
            assert_eq!(v(&o.2), v(&input(r as u32, 3)));
            assert_eq!(v(&o.3[0]), v(&part(0, r as u32)));
        }
        shutdown_all(&a).await;
    });
}

/// COL-1, one verdict: with one rank's shape off in a four-rank all-reduce, two of its ring
/// neighbours find the mismatch, each with its own view; every member must fail with the
/// same message (eight runs; on the old code each half of the group reported its own text).
/// The same for a gather and an all-to-all.
#[test]
fn a_mismatch_fails_every_member_with_one_message() {
    run(120, async {
        let a = group(4).await;
        for run in 0..8 {
            let outs = on_all(&a, |g, r| async move {
                let len = if r == 2 { 9 } else { 8 };
                g.all_reduce(&input(r, len), ReduceOp::Sum).await
            })
            .await;
            let msgs: Vec<String> = outs
                .into_iter()
                .map(|o| o.unwrap_err().to_string())
                .collect();
            assert!(msgs[0].contains("shape"), "{msgs:?}");
            assert!(msgs.iter().all(|m| *m == msgs[0]), "run {run}: {msgs:#?}");
        }
        let outs = on_all(&a, |g, r| async move {
            let len = if r == 3 { 2 } else { 3 };
            g.gather(&input(r, len), 0).await.map(|_| ())
        })
        .await;
        let msgs: Vec<String> = outs
            .into_iter()
            .map(|o| o.unwrap_err().to_string())
            .collect();
        assert!(
            msgs.iter().all(|m| *m == msgs[0] && m.contains("shape")),
            "{msgs:#?}"
        );
        let outs = on_all(&a, |g, r| async move {
            let cols = if r == 1 { 2 } else { 3 };
            let parts = (0..4)
                .map(|_| Tensor::zeros((2, cols), DType::F32, &Device::Cpu).unwrap())
                .collect();
            g.all_to_all(parts).await.map(|_| ())
        })
        .await;
        let msgs: Vec<String> = outs
            .into_iter()
            .map(|o| o.unwrap_err().to_string())
            .collect();
        assert!(
            msgs.iter().all(|m| *m == msgs[0] && m.contains("shape")),
            "{msgs:#?}"
        );
        // The group still works afterwards.
        let ok = on_all(&a, |g, r| async move {
            g.all_reduce(&input(r, 4), ReduceOp::Sum).await
        })
        .await;
        assert!(ok.iter().all(|o| o.is_ok()));
        shutdown_all(&a).await;
    });
}

/// COL-2 for the new collectives: a member declared failed in the middle of each operation
/// fails it on the members that wait for it, naming it.
#[test]
fn a_member_failing_mid_operation_fails_it_naming_the_member() {
    run(60, async {
        let a = start_group(
            3,
            Transport::Tcp,
            Secret::generate(),
            |_| collectives::install(Registry::builder()).unwrap().build(),
            |_, c| {
                c.with_heartbeat_interval(Duration::from_millis(100))
                    .with_failure_timeout(Duration::from_millis(800))
                    .with_shutdown_timeout(Duration::from_secs(5))
            },
        )
        .await
        .expect("group starts");
        // Ranks 0 and 2 enter each operation; rank 1 never does, and then stops answering.
        let live = [a[0].clone(), a[2].clone()];
        let ops = on_all(&live, |g, r| async move {
            let red = g.reduce_async(&input(r, 6), ReduceOp::Sum, 0);
            let gat = g.gather_async(&input(r, 6), 0);
            let parts = (r == 0).then(|| (0..3).map(|j| input(j, 2)).collect());
            let sca = g.scatter_async(parts, 0);
            let a2a = g.all_to_all_async((0..3).map(|j| part(r, j)).collect());
            let errs = [
                red.wait().await.map(|_| ()),
                gat.wait().await.map(|_| ()),
                sca.wait().await.map(|_| ()),
                a2a.wait().await.map(|_| ()),
            ];
            (r, errs)
        });
        let silence = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            rpc_core::testing::silence(&a[1], true);
        };
        let (outs, ()) = tokio::join!(ops, silence);
        for (r, errs) in outs {
            for (i, e) in errs.into_iter().enumerate() {
                // The scatter (op 2) does not wait on worker1, nor does rank 2's gather (it
                // only sends to the root); every other of these operations does.
                if i == 2 || (r == 2 && i == 1) {
                    continue;
                }
                let e = e.expect_err("worker1 never took part");
                let chain = rpc_core::error_chain(&e);
                assert!(chain.contains("worker1"), "rank {r}, op {i}: {chain}");
            }
        }
        let _ = tokio::join!(a[0].shutdown(), a[2].shutdown());
        let _ = a[1].shutdown_within(Duration::from_millis(500)).await;
    });
}

/// COL-1 for a call that is wrong on one member only: a root that is not a member fails
/// a reduce, a gather and a scatter on every member at once with that member's message, not
/// only on the one that got it wrong while the others wait for it until their timeout (20 s
/// here). A scatter's root waits for every member's header before it sends the parts: a
/// member that passes a bad root, or passes parts without being the root, fails every
/// member with one message. Before, nobody waited for such a member: it failed alone, the
/// root completed and the others got their parts (seen: `[true, true, true, false]`). The
/// group goes on in step.
#[test]
fn a_call_wrong_on_one_member_fails_every_member_at_once() {
    run(120, async {
        let a = group(4).await;
        let started = std::time::Instant::now();
        let reduce = on_all(&a, |g, r| async move {
            let root = if r == 2 { 9 } else { 0 };
            g.reduce(&input(r, 8), ReduceOp::Sum, root)
                .await
                .map(|_| ())
        })
        .await;
        let gather = on_all(&a, |g, r| async move {
            let root = if r == 1 { 9 } else { 0 };
            g.gather(&input(r, 8), root).await.map(|_| ())
        })
        .await;
        let scatter = on_all(&a, |g, r| async move {
            let parts = (r == 0 || r == 3).then(|| (0..4).map(|t| part(0, t)).collect());
            g.scatter(parts, 0).await.map(|_| ())
        })
        .await;
        let scatter_from_bad_root = on_all(&a, |g, r| async move {
            let parts = (r == 0).then(|| (0..4).map(|t| part(0, t)).collect());
            let root = if r == 0 { 9 } else { 0 };
            g.scatter(parts, root).await.map(|_| ())
        })
        .await;
        let scatter_to_bad_root = on_all(&a, |g, r| async move {
            let parts = (r == 0).then(|| (0..4).map(|t| part(0, t)).collect());
            let root = if r == 2 { 9 } else { 0 };
            g.scatter(parts, root).await.map(|_| ())
        })
        .await;
        let took = started.elapsed();
        for (outs, says) in [
            (reduce, "root 9 is not a member"),
            (gather, "root 9 is not a member"),
            (scatter_from_bad_root, "root 9 is not a member"),
            (scatter_to_bad_root, "root 9 is not a member"),
            (
                scatter,
                "rank 3 passed parts to scatter; only the root (rank 0) passes them",
            ),
        ] {
            let msgs: Vec<String> = outs
                .into_iter()
                .map(|o| o.unwrap_err().to_string())
                .collect();
            assert!(
                msgs.iter().all(|m| *m == msgs[0] && m.contains(says)),
                "{msgs:#?}"
            );
        }
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let ok = on_all(&a, |g, r| async move {
            g.all_reduce(&input(r, 4), ReduceOp::Sum).await
        })
        .await;
        assert!(ok.iter().all(|o| o.is_ok()), "{ok:?}");
        shutdown_all(&a).await;
    });
}

/// The failures above came at once, not after a member's timeout (20 s here), and the group
/// goes on in step: its next all-reduce succeeds everywhere. Ends the group.
async fn in_step_at_once(a: &[Agent], started: std::time::Instant) {
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let ok = on_all(a, |g, r| async move {
        g.all_reduce(&input(r, 4), ReduceOp::Sum).await
    })
    .await;
    assert!(ok.iter().all(|o| o.is_ok()), "{ok:?}");
    shutdown_all(a).await;
}

/// The one message every member's call failed with (panics unless all failed alike).
fn one_message<T: std::fmt::Debug>(outs: &[Result<T, collectives::CollectiveError>]) -> String {
    let msgs: Vec<String> = outs
        .iter()
        .map(|o| o.as_ref().expect_err("every member fails").to_string())
        .collect();
    assert!(msgs.iter().all(|m| *m == msgs[0]), "{msgs:#?}");
    msgs[0].clone()
}

/// COL-4 for `all_to_all_single`: splits that do not fit the tensor on one member failed it
/// there alone, before it took the operation's place, so the others waited for it until
/// their timeout (20 s here) and every later operation of the group paired with the wrong
/// one. Now every member fails at once with one message naming it, and the group goes on.
#[test]
fn splits_that_do_not_fit_on_one_member_fail_every_member_at_once() {
    run(120, async {
        let a = group(3).await;
        let started = std::time::Instant::now();
        for bad in [Some(vec![1, 1]), Some(vec![2, 2, 3]), None] {
            let outs = on_all(&a, |g, r| {
                let bad = bad.clone();
                async move {
                    let rows = if r == 1 && bad.is_none() { 7 } else { 6 };
                    let t = Tensor::zeros((rows, 2), DType::F32, &Device::Cpu).unwrap();
                    let splits = if r == 1 { bad } else { Some(vec![2, 2, 2]) };
                    g.all_to_all_single(&t, splits.as_deref()).await
                }
            })
            .await;
            let msg = one_message(&outs);
            assert!(msg.contains("rank 1") && msg.contains("rows"), "{msg}");
        }
        in_step_at_once(&a, started).await;
    });
}

/// COL-1 for a broadcast: a shape that differs from the root's failed the others while the
/// root returned Ok (it waited for nobody), and a root that passed a root that is not a
/// member failed alone while the others waited for its tensor until their timeout. Now every
/// member fails with one message in both cases. The mismatch is found by the root alone, so
/// this also checks that a verdict's aborts are sent in full when the finder's own operation
/// ends first (its other receives fail with the verdict and drop the finding's future).
#[test]
fn a_broadcast_fails_every_member_with_one_message() {
    run(120, async {
        let a = group(3).await;
        let started = std::time::Instant::now();
        // The root alone finds the mismatch, while it still waits for rank 1's header (which
        // comes late): its verdict must reach the others although that receive fails first.
        for _ in 0..3 {
            let outs = on_all(&a, |g, r| async move {
                if r == 1 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let len = if r == 2 { 4 } else { 3 };
                g.broadcast(&input(r, len), 0).await
            })
            .await;
            assert!(one_message(&outs).contains("shape"));
        }
        let outs = on_all(&a, |g, r| async move {
            let root = if r == 0 { 9 } else { 0 };
            g.broadcast(&input(r, 3), root).await
        })
        .await;
        assert!(one_message(&outs).contains("root 9 is not a member"));
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        let got = on_all(&a, |g, r| async move { g.broadcast(&input(r, 3), 1).await }).await;
        for t in got {
            assert_eq!(v(&t.unwrap()), v(&input(1, 3)));
        }
        shutdown_all(&a).await;
    });
}

/// A mean of integers is the sum divided by the number of members, rounded toward zero (as
/// NCCL's average of integers); it was 0 everywhere (the sum times `1/n`, truncated first).
#[test]
fn a_mean_of_integers_divides_the_sum() {
    run(60, async {
        let a = group(3).await;
        let outs = on_all(&a, |g, r| async move {
            let mut got = vec![];
            for dt in [DType::U8, DType::U32, DType::I64] {
                let t = Tensor::new(&[1f32 + r as f32, 2., 7., 0., 5., 3.], &Device::Cpu);
                let t = t.unwrap().to_dtype(dt).unwrap();
                let all = g.all_reduce(&t, ReduceOp::Mean).await.unwrap();
                let one = g.reduce(&t, ReduceOp::Mean, 1).await.unwrap();
                let mine = g.reduce_scatter(&t, ReduceOp::Mean).await.unwrap();
                let mine = Tensor::cat(&g.all_gather(&mine).await.unwrap(), 0).unwrap();
                for x in [Some(all), one, Some(mine)].into_iter().flatten() {
                    got.push(x.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap());
                }
            }
            (r, got)
        })
        .await;
        for (r, got) in outs {
            assert_eq!(got.len(), if r == 1 { 9 } else { 6 }, "rank {r}");
            for g in got {
                assert_eq!(g, [2., 2., 7., 0., 5., 3.], "rank {r}");
            }
        }
        shutdown_all(&a).await;
    });
}

/// Integer reductions wrap on overflow, as PyTorch's and NCCL's do: a `u8` sum of 200 and
/// 100 is 44 and an `i64` product past `i64::MAX` keeps its low 64 bits. In a debug build
/// they panicked inside the reduction (candle's checked arithmetic) and the operation never
/// returned.
#[test]
fn integer_reductions_wrap_on_overflow() {
    run(60, async {
        let a = group(2).await;
        let outs = on_all(&a, |g, r| async move {
            let bytes = Tensor::new(&[200u8 - 100 * r as u8, 255, 1, 0], &Device::Cpu).unwrap();
            let big = Tensor::new(&[i64::MAX, -3, i64::MIN + r as i64, 1], &Device::Cpu).unwrap();
            let mut got = vec![];
            for (t, op) in [
                (&bytes, ReduceOp::Sum),
                (&bytes, ReduceOp::Product),
                (&big, ReduceOp::Sum),
                (&big, ReduceOp::Product),
            ] {
                let all = g.all_reduce(t, op).await.unwrap();
                let one = g.reduce(t, op, 0).await.unwrap();
                let mine = g.reduce_scatter(t, op).await.unwrap();
                let mine = Tensor::cat(&g.all_gather(&mine).await.unwrap(), 0).unwrap();
                for x in [Some(all), one, Some(mine)].into_iter().flatten() {
                    got.push(x.to_dtype(DType::I64).unwrap().to_vec1::<i64>().unwrap());
                }
            }
            (r, got)
        })
        .await;
        let want: [[i64; 4]; 4] = [
            [44, 254, 2, 0],
            [(200u8.wrapping_mul(100)) as i64, 1, 1, 0],
            [i64::MAX.wrapping_add(i64::MAX), -6, 1, 2],
            [
                i64::MAX.wrapping_mul(i64::MAX),
                9,
                i64::MIN.wrapping_mul(i64::MIN + 1),
                1,
            ],
        ];
        for (r, got) in outs {
            let per = if r == 0 { 3 } else { 2 };
            assert_eq!(got.len(), 4 * per, "rank {r}");
            for (i, g) in got.iter().enumerate() {
                assert_eq!(g[..], want[i / per], "rank {r}, result {i}");
            }
        }
        shutdown_all(&a).await;
    });
}

/// COL-1 for the call itself: members that reach the same place in the group's sequence with
/// different calls fail every member with one message naming both. A reduction that differs
/// on one member (a max where the others sum) returned Ok everywhere with results that
/// differed from member to member; an all-gather where the others all-reduce failed on some
/// members only, with "a chunk of .. bytes arrived where .. elements were expected". The
/// group goes on in step.
#[test]
fn members_in_different_calls_fail_every_member_with_one_message() {
    run(120, async {
        let a = group(3).await;
        let started = std::time::Instant::now();
        let outs = on_all(&a, |g, r| async move {
            let op = if r == 2 { ReduceOp::Max } else { ReduceOp::Sum };
            g.all_reduce(&input(r, 6), op).await.map(|t| v(&t))
        })
        .await;
        let msg = one_message(&outs);
        assert!(msg.contains("max") && msg.contains("sum"), "{msg}");
        let outs = on_all(&a, |g, r| async move {
            match r {
                1 => g.all_gather(&input(r, 6)).await.map(|_| ()),
                _ => g.all_reduce(&input(r, 6), ReduceOp::Sum).await.map(|_| ()),
            }
        })
        .await;
        // Each member names its own call first; the verdict after it is one.
        let verdicts: Vec<String> = outs
            .iter()
            .map(|o| {
                let e = o.as_ref().expect_err("every member fails").to_string();
                e.split_once("failed: ").expect("a verdict").1.to_owned()
            })
            .collect();
        assert!(verdicts.iter().all(|m| *m == verdicts[0]), "{verdicts:#?}");
        let msg = &verdicts[0];
        assert!(
            msg.contains("all_gather") && msg.contains("all_reduce"),
            "{msg}"
        );
        let outs = on_all(&a, |g, r| async move {
            let op = if r == 0 { ReduceOp::Min } else { ReduceOp::Sum };
            g.reduce(&input(r, 6), op, 1).await.map(|_| ())
        })
        .await;
        let msg = one_message(&outs);
        assert!(msg.contains("min") && msg.contains("sum"), "{msg}");
        in_step_at_once(&a, started).await;
    });
}

/// ROOT-1: members that name different roots, each of them a member, fail a broadcast, a
/// reduce, a gather and a scatter on every member with one message naming both roots, each
/// within 5 s (a member still waiting after a second compares its call with its
/// neighbours'), and the group goes on in step. Before, each member waited for a root that
/// never sent to it until its timeout (20 s here), and a reduce's or a scatter's members
/// that agreed with the real root returned Ok beside the others' errors.
#[test]
fn members_that_name_different_roots_fail_every_member_at_once() {
    for (n, patterns) in [
        (2, vec![vec![0, 1], vec![1, 0]]),
        (
            4,
            vec![vec![0, 0, 1, 0], vec![0, 1, 0, 0], vec![3, 3, 2, 2]],
        ),
    ] {
        run(120, async move {
            let a = group(n).await;
            for roots in patterns {
                let root_of = |r: u32| roots[r as usize];
                for op in ["broadcast", "reduce", "gather", "scatter"] {
                    let started = std::time::Instant::now();
                    let outs = on_all(&a, |g, r| async move {
                        let (t, root) = (input(r, 6), root_of(r));
                        match op {
                            "broadcast" => g.broadcast(&t, root).await.map(drop),
                            "reduce" => g.reduce(&t, ReduceOp::Sum, root).await.map(drop),
                            "gather" => g.gather(&t, root).await.map(drop),
                            _ => {
                                let parts =
                                    (root == r).then(|| (0..n).map(|t| part(r, t)).collect());
                                g.scatter(parts, root).await.map(drop)
                            }
                        }
                    })
                    .await;
                    let took = started.elapsed();
                    let msg = one_message(&outs);
                    let roots = (0..4)
                        .filter(|r| msg.contains(&format!("root {r})")))
                        .count();
                    assert!(msg.contains(op) && roots == 2, "{op} {roots:?}: {msg}");
                    assert!(
                        took < Duration::from_secs(5),
                        "{op} {roots:?} took {took:?}"
                    );
                }
            }
            let ok = on_all(&a, |g, r| async move {
                g.all_reduce(&input(r, 4), ReduceOp::Sum).await
            })
            .await;
            assert!(ok.iter().all(|o| o.is_ok()), "{ok:?}");
            shutdown_all(&a).await;
        });
    }
}

/// ROOT-1 costs nothing and misfires never: a root that comes 2.5 s late (its members
/// compare their calls after a second, and agree) ends a broadcast, a gather and a scatter
/// with the right results everywhere, and no member's mailbox keeps a message afterwards
/// (MB-3: a neighbour's message for an operation that member ended is not kept).
#[test]
fn a_late_root_is_not_a_mismatch() {
    run(120, async {
        let a = group(3).await;
        for op in ["broadcast", "gather", "scatter"] {
            let outs = on_all(&a, |g, r| async move {
                if r == 1 {
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                }
                let t = input(r, 6);
                match op {
                    "broadcast" => g.broadcast(&t, 1).await.map(|t| vec![v(&t)]),
                    "gather" => g
                        .gather(&t, 1)
                        .await
                        .map(|all| all.unwrap_or_default().iter().map(v).collect()),
                    _ => {
                        let parts = (r == 1).then(|| (0..3).map(|j| input(j + 7, 4)).collect());
                        g.scatter(parts, 1).await.map(|t| vec![v(&t)])
                    }
                }
            })
            .await;
            for (r, o) in outs.into_iter().enumerate() {
                let got = o.unwrap_or_else(|e| panic!("{op} on rank {r}: {e}"));
                let want: Vec<Vec<f32>> = match op {
                    "broadcast" => vec![v(&input(1, 6))],
                    "gather" if r == 1 => (0..3).map(|j| v(&input(j, 6))).collect(),
                    "gather" => vec![],
                    _ => vec![v(&input(r as u32 + 7, 4))],
                };
                assert_eq!(got, want, "{op} on rank {r}");
            }
        }
        // Every neighbour's message has reached its member by now.
        tokio::time::sleep(Duration::from_millis(200)).await;
        for w in &a {
            let held = collectives::mailbox_stats(w).queued_messages;
            assert_eq!(held, 0, "rank {} holds {held} messages", w.rank());
        }
        shutdown_all(&a).await;
    });
}

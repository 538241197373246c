//! Point-to-point messages and ring collectives across in-process workers (TCP and memory).

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use collectives::ReduceOp;
use integration_tests::{each_transport, ps_grad, run, shutdown_all};
use rpc_core::{Agent, Transport};

async fn group(n: u32, t: Transport) -> Vec<Agent> {
    integration_tests::collective_group(n, t).await
}

/// Rank `r`'s input: distinct per rank, awkward length.
fn input(r: u32, len: usize) -> Tensor {
    let v: Vec<f32> = (0..len)
        .map(|i| ((i * 7 + r as usize * 13) % 101) as f32 * 0.37 - 11.0)
        .collect();
    Tensor::from_vec(v, len, &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn point_to_point_is_matched_by_source_and_tag() {
    each_transport(30, |t| async move {
        let a = group(3, t).await;
        let x = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
        let y = Tensor::new(&[3f32], &Device::Cpu).unwrap();
        // Tag 7 sent after tag 5, received first; a message from rank 2 does not match rank 1.
        collectives::send(&a[1], 0u32, 5, &x).await.unwrap();
        collectives::send(&a[1], 0u32, 7, &y).await.unwrap();
        collectives::send(&a[2], 0u32, 5, &y).await.unwrap();
        assert_eq!(
            collectives::recv(&a[0], 1u32, 7)
                .await
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![3.]
        );
        assert_eq!(
            collectives::recv(&a[0], 1u32, 5)
                .await
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![1., 2.]
        );
        assert_eq!(
            collectives::recv(&a[0], 2u32, 5)
                .await
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![3.]
        );
        // Non-blocking: the receive is posted before the send.
        let h = collectives::irecv(&a[2], 0, 9);
        collectives::isend(&a[0], 2, 9, &x).wait().await.unwrap();
        assert_eq!(
            h.wait().await.unwrap().to_vec1::<f32>().unwrap(),
            vec![1., 2.]
        );
        // A worker sends to itself like to any other.
        collectives::send(&a[0], 0u32, 11, &x).await.unwrap();
        let own = collectives::recv(&a[0], 0u32, 11).await.unwrap();
        assert_eq!(own.to_vec1::<f32>().unwrap(), vec![1., 2.]);
        // A send to a worker the group does not have is a send error that names it.
        let e = collectives::send(&a[0], "nosuch", 1, &x).await.unwrap_err();
        let e = rpc_core::error_chain(&e);
        assert!(e.starts_with("send to worker `nosuch` failed"), "{e}");
        shutdown_all(&a).await;
    });
}

#[test]
fn all_reduce_matches_a_local_reduction_and_is_identical_everywhere() {
    for n in [2u32, 3, 4] {
        each_transport(60, |t| async move {
            let a = group(n, t).await;
            for (op, len) in [
                (ReduceOp::Sum, 1001usize),
                (ReduceOp::Mean, 7),
                (ReduceOp::Max, 3),
                (ReduceOp::Min, 70_000),
            ] {
                let outs = futures::future::join_all(a.iter().map(|w| {
                    let g = collectives::world(w);
                    let x = input(w.rank(), len);
                    async move { g.all_reduce(&x, op).await.unwrap() }
                }))
                .await;
                let xs: Vec<Tensor> = (0..n).map(|r| input(r, len)).collect();
                let mut expect = xs[0].clone();
                for x in &xs[1..] {
                    expect = match op {
                        ReduceOp::Sum | ReduceOp::Mean => (&expect + x).unwrap(),
                        ReduceOp::Max => expect.maximum(x).unwrap(),
                        _ => expect.minimum(x).unwrap(),
                    };
                }
                if op == ReduceOp::Mean {
                    expect = (expect / n as f64).unwrap();
                }
                let err = (&outs[0] - &expect)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(err < 1e-3, "{op:?} n={n}: {err}");
                for o in &outs[1..] {
                    assert_eq!(
                        bits(o),
                        bits(&outs[0]),
                        "{op:?}: every rank gets bit-identical results"
                    );
                }
            }
            shutdown_all(&a).await;
        });
    }
}

#[test]
fn broadcast_all_gather_reduce_scatter_barrier_and_subgroups() {
    each_transport(60, |t| async move {
        let a = group(4, t).await;
        let run_all = |f: fn(
            collectives::ProcessGroup,
            u32,
        ) -> futures::future::BoxFuture<'static, Vec<f32>>| {
            futures::future::join_all(a.iter().map(move |w| f(collectives::world(w), w.rank())))
        };
        let b = run_all(|g, r| {
            Box::pin(async move {
                g.broadcast(&input(r, 5), 2)
                    .await
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
        })
        .await;
        assert!(b
            .iter()
            .all(|v| *v == input(2, 5).to_vec1::<f32>().unwrap()));
        let gathered = run_all(|g, r| {
            Box::pin(async move {
                let all = g.all_gather(&input(r, 3)).await.unwrap();
                Tensor::cat(&all, 0).unwrap().to_vec1().unwrap()
            })
        })
        .await;
        let expect: Vec<f32> = (0..4)
            .flat_map(|r| input(r, 3).to_vec1::<f32>().unwrap())
            .collect();
        assert!(gathered.iter().all(|v| *v == expect));
        let scattered = run_all(|g, r| {
            Box::pin(async move {
                g.reduce_scatter(&input(r, 10), ReduceOp::Sum)
                    .await
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
        })
        .await;
        let total: Vec<f32> = (0..4)
            .map(|r| input(r, 10))
            .reduce(|x, y| (x + y).unwrap())
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(scattered.concat().len(), 10);
        for (got, want) in scattered.concat().iter().zip(&total) {
            assert!((got - want).abs() < 1e-4);
        }
        // A barrier holds everyone until the last arrives.
        let start = Instant::now();
        futures::future::join_all(a.iter().map(|w| async move {
            if w.rank() == 3 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            collectives::world(w).barrier().await.unwrap();
            assert!(
                start.elapsed() >= Duration::from_millis(190),
                "rank {} left the barrier early",
                w.rank()
            );
        }))
        .await;
        // A subgroup {0, 2}; rank 1 is not a member.
        let sub = futures::future::join_all([0usize, 2].map(|i| {
            let g = collectives::new_group(&a[i], &[0, 2]).unwrap();
            async move {
                g.all_reduce(&input(i as u32, 4), ReduceOp::Sum)
                    .await
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            }
        }))
        .await;
        let want = (input(0, 4) + input(2, 4))
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(sub.iter().all(|v| *v == want));
        let err = collectives::new_group(&a[1], &[0, 2])
            .unwrap()
            .all_reduce(&input(1, 4), ReduceOp::Sum)
            .await
            .unwrap_err();
        assert!(
            matches!(err, collectives::CollectiveError::NotMember { rank: 1, .. }),
            "{err}"
        );
        shutdown_all(&a).await;
    });
}

#[test]
fn mismatched_shapes_fail_everywhere_promptly() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        let start = Instant::now();
        let outs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let len = if w.rank() == 1 { 9 } else { 8 };
            async move { g.all_reduce(&input(w.rank(), len), ReduceOp::Sum).await }
        }))
        .await;
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "a mismatch must not wait for the timeout"
        );
        for o in outs {
            let e = o.unwrap_err().to_string();
            assert!(e.contains("shape"), "{e}");
        }
        // The group still works afterwards.
        let ok = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            async move { g.all_reduce(&input(0, 4), ReduceOp::Sum).await.unwrap() }
        }))
        .await;
        assert_eq!(ok.len(), 3);
        shutdown_all(&a).await;
    });
}

#[test]
fn async_collectives_overlap_and_pair_in_call_order() {
    each_transport(60, |t| async move {
        let a = group(2, t).await;
        let outs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let r = w.rank();
            async move {
                let w1 = g.all_reduce_async(&input(r, 100), ReduceOp::Sum);
                let w2 = g.all_reduce_async(&input(r + 10, 50), ReduceOp::Max);
                let (x, y) = (w1.wait().await.unwrap(), w2.wait().await.unwrap());
                (x.dims().to_vec(), y.dims().to_vec())
            }
        }))
        .await;
        assert!(outs.iter().all(|(x, y)| x == &[100] && y == &[50]));
        shutdown_all(&a).await;
    });
}

/// A group abandoned in the middle of a collective (rank 0 sent its part, rank 1 never
/// came) and re-created over the same ranks under another tag: the new group's collectives
/// never meet the old one's leftovers, although no member was replaced.
#[test]
fn tagged_groups_over_the_same_ranks_share_nothing() {
    each_transport(60, |t| async move {
        let a = group(2, t).await;
        let old = collectives::new_group_tagged(&a[0], &[0, 1], 1).unwrap();
        // Rank 0's half of an all-reduce rank 1 never joins: its message waits at rank 1.
        let abandoned = old.all_reduce_async(&input(7, 64), ReduceOp::Sum);
        let outs = futures::future::join_all(a.iter().map(|w| async move {
            let g = collectives::new_group_tagged(w, &[0, 1], 2).unwrap();
            g.all_reduce(&input(w.rank(), 64), ReduceOp::Sum)
                .await
                .unwrap()
        }))
        .await;
        let want = (input(0, 64) + input(1, 64)).unwrap();
        for out in &outs {
            assert_eq!(bits(out), bits(&want));
        }
        drop(abandoned);
        shutdown_all(&a).await;
    });
}

/// The dataset of the data-parallel test: 32 samples, 6 features, 3 targets.
fn dataset() -> (Tensor, Tensor) {
    let x: Vec<f64> = (0..32 * 6)
        .map(|i| ((i * 37 % 101) as f64 / 101.0) - 0.5)
        .collect();
    let y: Vec<f64> = (0..32 * 3)
        .map(|i| ((i * 53 % 97) as f64 / 97.0) - 0.5)
        .collect();
    (
        Tensor::from_vec(x, (32, 6), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (32, 3), &Device::Cpu).unwrap(),
    )
}

fn init_params(offset: f64) -> Vec<candle_core::Var> {
    let mk = |r: usize, c: usize, salt: usize| {
        let v: Vec<f64> = (0..r * c)
            .map(|i| (((i * 31 + salt) % 17) as f64 / 17.0 - 0.5) * 0.5 + offset)
            .collect();
        candle_core::Var::from_tensor(&Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()).unwrap()
    };
    vec![mk(6, 8, 1), mk(1, 8, 2), mk(8, 3, 3)]
}

fn mlp_loss(p: &[candle_core::Var], x: &Tensor, y: &Tensor) -> Tensor {
    let h = x
        .matmul(p[0].as_tensor())
        .unwrap()
        .broadcast_add(p[1].as_tensor())
        .unwrap()
        .tanh()
        .unwrap();
    let out = h.matmul(p[2].as_tensor()).unwrap();
    (out - y).unwrap().sqr().unwrap().mean_all().unwrap()
}

#[test]
fn data_parallel_training_tracks_single_process_training() {
    use candle_nn::Optimizer;
    const B: usize = 8;
    const STEPS: usize = 20;
    for n in [2u32, 4] {
        run(120, async move {
            let a = group(n, Transport::Memory(rpc_core::MemoryNetwork::new())).await;
            let (x, y) = dataset();
            // One process, global batch B.
            let reference = init_params(0.0);
            let mut sgd = candle_nn::SGD::new(reference.clone(), 0.1).unwrap();
            let sampler = collectives::DistributedSampler::new(32, 1, 0, 99);
            for step in 0..STEPS {
                let (epoch, k) = ((step * B / 32) as u64, step % (32 / B));
                let idx: Vec<u32> = sampler.permutation(epoch)[k * B..(k + 1) * B]
                    .iter()
                    .map(|&i| i as u32)
                    .collect();
                let ids = Tensor::new(idx.as_slice(), &Device::Cpu).unwrap();
                let l = mlp_loss(
                    &reference,
                    &x.index_select(&ids, 0).unwrap(),
                    &y.index_select(&ids, 0).unwrap(),
                );
                sgd.step(&l.backward().unwrap()).unwrap();
            }
            // N ranks on B/N each; non-root ranks start from other values (broadcast fixes that).
            let finals = futures::future::join_all(a.iter().map(|w| {
                let (x, y) = (x.clone(), y.clone());
                async move {
                    let r = w.rank() as usize;
                    let ddp = collectives::DistributedDataParallel::with_bucket_bytes(
                        collectives::world(w),
                        init_params(r as f64 * 0.3),
                        200,
                    )
                    .await
                    .unwrap();
                    let mut sgd = candle_nn::SGD::new(ddp.vars().to_vec(), 0.1).unwrap();
                    let sampler = collectives::DistributedSampler::new(32, n as usize, r, 99);
                    let b = B / n as usize;
                    for step in 0..STEPS {
                        let (epoch, k) = ((step * B / 32) as u64, step % (32 / B));
                        let mine = sampler.indices(epoch);
                        let idx: Vec<u32> =
                            mine[k * b..(k + 1) * b].iter().map(|&i| i as u32).collect();
                        let ids = Tensor::new(idx.as_slice(), &Device::Cpu).unwrap();
                        let l = mlp_loss(
                            ddp.vars(),
                            &x.index_select(&ids, 0).unwrap(),
                            &y.index_select(&ids, 0).unwrap(),
                        );
                        let mut g = l.backward().unwrap();
                        ddp.reduce_gradients(&mut g).await.unwrap();
                        sgd.step(&g).unwrap();
                    }
                    ddp.vars()
                        .iter()
                        .map(|v| v.as_tensor().clone())
                        .collect::<Vec<_>>()
                }
            }))
            .await;
            for (rank, params) in finals.iter().enumerate() {
                for (p, q) in params.iter().zip(&reference) {
                    let d = integration_tests::max_abs_diff(p, q.as_tensor());
                    assert!(d <= 1e-5, "n={n} rank {rank}: parameter differs by {d}");
                }
            }
            // The model moved, so matching means something.
            let moved = integration_tests::max_abs_diff(
                reference[2].as_tensor(),
                init_params(0.0)[2].as_tensor(),
            );
            assert!(
                moved > 1e-3,
                "training moved the parameters by only {moved}"
            );
            shutdown_all(&a).await;
        });
    }
}

#[test]
fn parameter_server_consistency_modes_bound_staleness() {
    use collectives::{Consistency, PsClient};
    const STEPS: u64 = 8;
    const LR: f64 = 0.05;
    for mode in [Consistency::Bsp, Consistency::Ssp(2), Consistency::Asp] {
        run(120, async move {
            let a = group(5, Transport::Memory(rpc_core::MemoryNetwork::new())).await;
            // Ranks 0 and 1 serve one half of the weights each; ranks 2..5 are trainers 0..3.
            for (server, shard) in [(0usize, 10u64), (1, 11)] {
                let half = Tensor::zeros(2, candle_core::DType::F64, &Device::Cpu).unwrap();
                collectives::serve_shard(&a[server], shard, vec![half], LR, mode, 3)
                    .expect("served");
            }
            futures::future::join_all((0..3usize).map(|t| {
                let client = PsClient::new(&a[t + 2], vec![(0, 10), (1, 11)], t);
                async move {
                    for step in 0..STEPS {
                        let shards = client.pull(step).await.unwrap();
                        let w: Vec<f64> = shards
                            .iter()
                            .flat_map(|s| s[0].to_vec1::<f64>().unwrap())
                            .collect();
                        if t == 0 {
                            // The deliberately slow trainer.
                            tokio::time::sleep(Duration::from_millis(40)).await;
                        }
                        let g = ps_grad(&w, t, step);
                        let halves = vec![
                            vec![Tensor::new(&g[..2], &Device::Cpu).unwrap()],
                            vec![Tensor::new(&g[2..], &Device::Cpu).unwrap()],
                        ];
                        client.push(step, halves).await.unwrap();
                    }
                }
            }))
            .await;
            let s0 = collectives::shard_stats(&a[0], 10).unwrap();
            let s1 = collectives::shard_stats(&a[1], 11).unwrap();
            let observed = s0.max_staleness.max(s1.max_staleness);
            assert_eq!(s0.clocks, vec![STEPS; 3], "every trainer finished");
            assert_eq!(s1.applied, vec![STEPS; 3], "every push is applied once");
            match mode {
                Consistency::Bsp => {
                    assert_eq!(observed, 0, "BSP lets no trainer ahead");
                    // BSP is deterministic: every step applies all trainers' gradients computed
                    // from the same parameters.
                    let mut w = vec![0.0f64; 4];
                    for step in 0..STEPS {
                        let gs: Vec<Vec<f64>> = (0..3).map(|t| ps_grad(&w, t, step)).collect();
                        for g in gs {
                            for (wi, gi) in w.iter_mut().zip(g) {
                                *wi -= LR * gi;
                            }
                        }
                    }
                    let got: Vec<f64> = [(0usize, 10u64), (1, 11)]
                        .iter()
                        .flat_map(|&(srv, sh)| {
                            let c = PsClient::new(&a[srv], vec![(srv as u32, sh)], 0);
                            futures::executor::block_on(async { c.pull(STEPS).await.unwrap() })[0]
                                [0]
                            .to_vec1::<f64>()
                            .unwrap()
                        })
                        .collect();
                    for (x, y) in got.iter().zip(&w) {
                        assert!((x - y).abs() < 1e-12, "{got:?} vs {w:?}");
                    }
                }
                Consistency::Ssp(s) => {
                    assert!(
                        observed <= s,
                        "SSP({s}) let a trainer {observed} steps ahead"
                    );
                    assert!(
                        observed > 0,
                        "with a slow trainer the others run ahead within the bound"
                    );
                }
                Consistency::Asp => assert!(
                    observed > 2,
                    "ASP does not hold fast trainers back: {observed}"
                ),
            }
            shutdown_all(&a).await;
        });
    }
}

/// Chunks of several ring pieces each (8 MiB pieces): every piece lands in its place, through
/// the reduce-scatter steps that fold straight into the outgoing blob and the rest.
#[test]
fn all_reduce_of_many_pieces_per_chunk() {
    let n = 3u32;
    let len = 3 * (2 * (2 << 20) + 12_345);
    let value = |r: u32, i: usize| ((r as usize * 7 + i) % 13) as f32;
    let (outs, stats) = run(120, async {
        let a = group(n, Transport::Tcp).await;
        let outs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let r = w.rank();
            async move {
                let mut buf: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                g.all_reduce_in_place(&mut buf, ReduceOp::Sum)
                    .await
                    .unwrap();
                buf
            }
        }))
        .await;
        let stats = a[0].bulk_stats();
        shutdown_all(&a).await;
        (outs, stats)
    });
    for (i, x) in outs[0].iter().enumerate() {
        let want: f32 = (0..n).map(|r| value(r, i)).sum();
        assert_eq!(*x, want, "element {i}");
    }
    assert!(outs.iter().all(|o| o == &outs[0]), "identical everywhere");
    assert!(stats.shared_blobs + stats.streamed_blobs >= 6, "{stats:?}");
}

#[test]
fn in_place_and_async_variants() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        let outs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let r = w.rank();
            async move {
                // In place, on the caller's own buffer.
                let mut buf: Vec<f32> = input(r, 1000).to_vec1().unwrap();
                g.all_reduce_in_place(&mut buf, ReduceOp::Sum)
                    .await
                    .unwrap();
                // Async variants, issued together and paired in call order.
                let b = g.broadcast_async(&input(r, 4), 1);
                let ga = g.all_gather_async(&input(r, 2));
                let rs = g.reduce_scatter_async(&input(r, 9), ReduceOp::Max);
                let (b, ga, rs) = (
                    b.wait().await.unwrap(),
                    ga.wait().await.unwrap(),
                    rs.wait().await.unwrap(),
                );
                (
                    buf,
                    b.to_vec1::<f32>().unwrap(),
                    ga.len(),
                    rs.dims().to_vec(),
                )
            }
        }))
        .await;
        let want: Vec<f32> = (0..3)
            .map(|r| input(r, 1000))
            .reduce(|x, y| (x + y).unwrap())
            .unwrap()
            .to_vec1()
            .unwrap();
        for (buf, b, ga, rs) in &outs {
            assert!(buf.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-3));
            assert_eq!(buf, &outs[0].0, "bit-identical on every rank");
            assert_eq!(b, &input(1, 4).to_vec1::<f32>().unwrap());
            assert_eq!((*ga, rs.as_slice()), (3, &[3usize][..]));
        }
        // Mismatched lengths in place fail on every rank.
        let errs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let len = if w.rank() == 2 { 11 } else { 10 };
            async move {
                g.all_reduce_in_place(&mut vec![1f64; len], ReduceOp::Sum)
                    .await
                    .is_err()
            }
        }))
        .await;
        assert!(errs.iter().all(|e| *e));
        shutdown_all(&a).await;
    });
}

/// An all-reduce whose buffer is still being filled keeps its place in the group's order:
/// the operation called after it (filled at once) completes while the first one's fill still
/// waits, and both pair up across the members as they were called (their lengths differ, so
/// a wrong pairing fails the header check). A fill that panics fails its member's work,
/// naming the cause.
#[test]
fn an_all_reduce_keeps_its_place_while_its_buffer_is_filled() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        let outs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let r = w.rank() as f32;
            async move {
                let (release, held) = std::sync::mpsc::channel::<()>();
                let first = g.all_reduce_fill_async(
                    move |_| {
                        held.recv_timeout(Duration::from_secs(20))
                            .expect("released once the second is done");
                        Ok(vec![r; 10])
                    },
                    ReduceOp::Sum,
                );
                let second = g.all_reduce_fill_async(move |_| Ok(vec![r * 10.0; 3]), ReduceOp::Max);
                let second = second.wait().await.unwrap();
                release.send(()).unwrap();
                (first.wait().await.unwrap(), second)
            }
        }))
        .await;
        for (first, second) in &outs {
            assert_eq!(first, &vec![3.0; 10]);
            assert_eq!(second, &vec![20.0; 3]);
        }
        let errs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            async move {
                g.all_reduce_fill_async::<f32, _>(|_| panic!("no buffer"), ReduceOp::Sum)
                    .wait()
                    .await
                    .unwrap_err()
                    .to_string()
            }
        }))
        .await;
        for e in errs {
            assert!(e.contains("filling the buffer failed"), "{e}");
        }
        shutdown_all(&a).await;
    });
}

/// COL-4's first half: every member failed within 10 s of `started` (not at the RPC
/// timeout), all with one message.
fn one_prompt_verdict(errs: &[String], started: Instant) {
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "failed after {took:?}: {errs:?}"
    );
    assert!(errs.iter().all(|e| e == &errs[0]), "{errs:?}");
}

/// COL-4's second half: after an operation failed everywhere, the group is in step: the
/// next all-reduce pairs up as called on every member of `a` (ranks 0, 1, ...).
async fn the_next_all_reduce_pairs_up(a: &[Agent]) {
    let next = futures::future::join_all(a.iter().map(|w| {
        let g = collectives::world(w);
        let r = w.rank() as f32;
        async move {
            g.all_reduce_fill_async(move |_| Ok(vec![r; 5]), ReduceOp::Sum)
                .wait()
                .await
                .unwrap()
        }
    }))
    .await;
    let want = (0..a.len()).sum::<usize>() as f32;
    assert!(next.iter().all(|v| v == &vec![want; 5]), "{next:?}");
}

/// COL-4: a member whose buffer cannot be made fails the operation on every member at once,
/// with one message naming it and the cause, and the group goes on in step (the next
/// operation pairs up as called). Before, only the failing member's work failed; the others
/// waited for it until the RPC timeout (20 s here).
#[test]
fn a_fill_that_fails_on_one_member_fails_the_operation_everywhere_naming_it() {
    each_transport(60, |t| async move {
        let a = group(3, t).await;
        let started = Instant::now();
        let errs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let r = w.rank();
            async move {
                g.all_reduce_fill_async(
                    move |_| match r {
                        1 => Err(candle_core::Error::Msg("out of memory".into()).into()),
                        _ => Ok(vec![r as f32; 1 << 20]),
                    },
                    ReduceOp::Sum,
                )
                .wait()
                .await
                .unwrap_err()
                .to_string()
            }
        }))
        .await;
        one_prompt_verdict(&errs, started);
        assert!(
            errs[0].contains("rank 1") && errs[0].contains("out of memory"),
            "{errs:?}"
        );
        the_next_all_reduce_pairs_up(&a).await;
        shutdown_all(&a).await;
    });
}

/// COL-4 through a communication hook: a member whose bucket `CompressHook` cannot cast fails
/// the all-reduce on every member (as a hook of a user's that wraps it would meet it), and the
/// next operation pairs up. Before, that member's work failed alone without taking the
/// operation's place: the others waited for it until the RPC timeout (20 s here), and its next
/// operation paired with theirs of the one before.
#[test]
fn a_hook_that_cannot_prepare_its_bucket_fails_the_operation_everywhere() {
    use collectives::{CommHook, CompressHook};
    run(60, async {
        let a = group(3, Transport::Tcp).await;
        let started = Instant::now();
        let errs = futures::future::join_all(a.iter().map(|w| {
            let g = collectives::world(w);
            let bucket = match w.rank() {
                // A type candle cannot convert: the cast to bf16 fails on this member only.
                1 => {
                    Tensor::from_raw_buffer(&[0u8; 8], candle_core::DType::F4, &[16], &Device::Cpu)
                }
                _ => Tensor::ones(16, candle_core::DType::F32, &Device::Cpu),
            }
            .unwrap();
            async move {
                CompressHook::bf16()
                    .reduce(&g, bucket, ReduceOp::Mean)
                    .wait()
                    .await
                    .unwrap_err()
                    .to_string()
            }
        }))
        .await;
        one_prompt_verdict(&errs, started);
        assert!(
            errs[0].contains("bf16 hook could not prepare the bucket on rank 1"),
            "{errs:?}"
        );
        the_next_all_reduce_pairs_up(&a).await;
        shutdown_all(&a).await;
    });
}

/// LANE-1: the ring's passes split over threads give the single thread's result, bit for
/// bit, on every member (chunks of two pieces, each split into up to four lanes, uneven).
#[test]
fn ring_threads_do_not_change_a_single_bit() {
    let n = 3u32;
    let len = 3 * (3 << 20) + 12_345;
    let value = |r: u32, i: usize| ((r as usize * 7919 + i * 31) % 1009) as f32 * 0.013 - 6.1;
    let outs = run(180, async {
        let a = group(n, Transport::Tcp).await;
        let mut outs = Vec::new();
        for (threads, op) in [
            (1, ReduceOp::Sum),
            (4, ReduceOp::Sum),
            (3, ReduceOp::Sum),
            (1, ReduceOp::Mean),
            (4, ReduceOp::Mean),
        ] {
            let got = futures::future::join_all(a.iter().map(|w| {
                let g = collectives::world(w).with_ring_threads(threads);
                let r = w.rank();
                async move {
                    let mut buf: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                    g.all_reduce_in_place(&mut buf, op).await.unwrap();
                    buf
                }
            }))
            .await;
            assert!(got.iter().all(|o| o == &got[0]), "identical everywhere");
            outs.push(got.into_iter().next().unwrap());
        }
        shutdown_all(&a).await;
        outs
    });
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(&outs[0], &outs[1]), "4 lanes differ from 1 (sum)");
    assert!(same(&outs[0], &outs[2]), "3 lanes differ from 1 (sum)");
    assert!(same(&outs[3], &outs[4]), "4 lanes differ from 1 (mean)");
    for (i, x) in outs[0].iter().enumerate().step_by(997) {
        let want: f32 = (0..n).map(|r| value(r, i)).sum();
        assert!((x - want).abs() < 1e-4, "element {i}: {x} against {want}");
    }
}

//! PS-4..6: a parameter server that loses a server process and a trainer. Ranks 0 and 1 serve
//! two shards, each the other's backup; ranks 2-4 are trainers under BSP. Server 1 freezes
//! mid-run: its shard fails over to the backup on rank 0 and the run ends with every
//! acknowledged update applied exactly once (the parameters equal the failure-free BSP
//! computation). A trainer freezes mid-run: the others go on without it, and a replacement
//! process joins under its index at the others' step and finishes the run.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use collectives::{Consistency, PsClient, Replica};
use integration_tests::elastic::ElasticGroup;
use integration_tests::*;
use rpc_core::{testing, Agent, MembershipChange, Transport};

const STEPS: u64 = 12;
const LR: f64 = 0.05;
/// `(shard id, primary rank, backup rank)`.
const SHARDS: [(u64, u32, u32); 2] = [(10, 0, 1), (11, 1, 0)];

fn registry() -> rpc_core::Registry {
    collectives::install(registry_builder()).unwrap().build()
}

/// The BSP run computed in one place: `live(step)` names the trainers whose gradients step
/// `step` applies.
fn expected(live: impl Fn(u64) -> Vec<usize>) -> Vec<f64> {
    let mut w = vec![0.0f64; 4];
    for step in 0..STEPS {
        let gs: Vec<Vec<f64>> = live(step)
            .into_iter()
            .map(|t| ps_grad(&w, t, step))
            .collect();
        for g in gs {
            for (wi, gi) in w.iter_mut().zip(g) {
                *wi -= LR * gi;
            }
        }
    }
    w
}

/// Five workers in memory, the two servers serving both shards.
async fn group() -> ElasticGroup {
    let g = ElasticGroup::start(
        5,
        Transport::Memory(rpc_core::MemoryNetwork::new()),
        registry,
        Duration::from_millis(600),
    )
    .await;
    serve(&g.agents);
    g
}

fn serve(a: &[Agent]) {
    for (shard, primary, backup) in SHARDS {
        for (rank, replica) in [
            (primary, Replica::Primary { backup }),
            (backup, Replica::Backup { primary }),
        ] {
            let half = Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
            collectives::serve_replica(
                &a[rank as usize],
                shard,
                vec![half],
                LR,
                Consistency::Bsp,
                3,
                replica,
            )
            .expect("served");
        }
    }
}

fn client(agent: &Agent, t: usize) -> PsClient {
    PsClient::new(agent, SHARDS.map(|(s, p, _)| (p, s)).to_vec(), t)
        .with_backups(SHARDS.map(|(_, _, b)| Some(b)))
}

/// Trains trainer `t` from step `from` to `to` (exclusive); `before(step)` runs before each
/// step's pull.
async fn train(c: &PsClient, t: usize, from: u64, to: u64, before: impl Fn(u64)) {
    for step in from..to {
        before(step);
        let shards = c.pull(step).await.unwrap();
        let w: Vec<f64> = shards
            .iter()
            .flat_map(|s| s[0].to_vec1::<f64>().unwrap())
            .collect();
        let g = ps_grad(&w, t, step);
        let halves = vec![
            vec![Tensor::new(&g[..2], &Device::Cpu).unwrap()],
            vec![Tensor::new(&g[2..], &Device::Cpu).unwrap()],
        ];
        c.push(step, halves).await.unwrap();
    }
}

/// The parameters `agent` holds for both shards.
async fn weights(agent: &Agent) -> Vec<f64> {
    let mut w = Vec::new();
    for (shard, _, _) in SHARDS {
        let c = PsClient::new(agent, vec![(agent.rank(), shard)], 0);
        w.extend(c.pull(STEPS).await.unwrap()[0][0].to_vec1::<f64>().unwrap());
    }
    w
}

fn assert_close(got: &[f64], want: &[f64]) {
    for (x, y) in got.iter().zip(want) {
        assert!((x - y).abs() < 1e-12, "{got:?} vs {want:?}");
    }
}

/// PS-4, PS-5: server 1 (primary of shard 11, backup of shard 10) freezes at step 5; the
/// trainers fail over to shard 11's backup on rank 0 and no acknowledged update is lost.
#[test]
fn a_server_fails_and_its_backup_loses_no_update() {
    run(120, async {
        let g = group().await;
        let a = &g.agents;
        let clients: Vec<PsClient> = (0..3).map(|t| client(&a[t + 2], t)).collect();
        // Trainer 0 freezes server 1 after step 4 and waits until the group has declared it
        // failed; the others are held at step 6 (BSP) meanwhile.
        let (t0, rest) = clients.split_first().unwrap();
        let first = async {
            train(t0, 0, 0, 5, |_| {}).await;
            testing::silence(&a[1], true);
            let by = std::time::Instant::now() + Duration::from_secs(10);
            while a[2].is_live(1u32).unwrap() {
                assert!(std::time::Instant::now() < by, "server 1 declared failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            train(t0, 0, 5, STEPS, |_| {}).await;
        };
        let others = rest
            .iter()
            .enumerate()
            .map(|(i, c)| train(c, i + 1, 0, STEPS, |_| {}));
        futures::future::join(first, futures::future::join_all(others)).await;
        for (t, c) in clients.iter().enumerate() {
            assert!(c.failed_over(1), "trainer {t} failed over shard 11");
            assert!(!c.failed_over(0), "shard 10's primary is alive");
            assert_eq!(c.acked_pushes(), 2 * STEPS, "trainer {t}");
        }
        for (shard, _, _) in SHARDS {
            let s = collectives::shard_stats(&a[0], shard).unwrap();
            assert_eq!(s.applied, vec![STEPS; 3], "shard {shard}: every push once");
            assert_eq!(s.replica, Replica::Sole, "shard {shard} is alone on rank 0");
        }
        assert_close(&weights(&a[0]).await, &expected(|_| vec![0, 1, 2]));
        // The survivors shut down together; the barrier names the failed server.
        let reports = futures::future::join_all([0, 2, 3, 4].map(|r| a[r].shutdown())).await;
        for r in reports {
            assert_eq!(r.aborted, 0, "{r:?}");
            assert!(r.barrier.unwrap_err().contains("[1]"));
        }
        a[1].shutdown_within(Duration::from_secs(1)).await;
    });
}

/// PS-3, PS-6: trainer 2 (rank 4) freezes before step 4; the others go on without it; a
/// replacement process for rank 4 joins under trainer index 2 at the others' step and
/// finishes; every shard applied exactly the acknowledged pushes.
#[test]
fn a_replacement_trainer_joins_at_the_others_step() {
    run(120, async {
        let g = group().await;
        let a = &g.agents;
        let mut watch = a[0].watch_membership();
        let clients: Vec<PsClient> = (0..3).map(|t| client(&a[t + 2], t)).collect();
        futures::future::join_all(
            clients
                .iter()
                .enumerate()
                .map(|(t, c)| train(c, t, 0, 4, |_| {})),
        )
        .await;
        testing::silence(&a[4], true);
        loop {
            let e = tokio::time::timeout(Duration::from_secs(10), watch.next())
                .await
                .expect("rank 4 declared failed within 10 s")
                .expect("the watch goes on");
            if e.rank == 4 && matches!(e.change, MembershipChange::Failed { .. }) {
                break;
            }
        }
        // The survivors run ahead without trainer 2 (PS-3) ...
        let survivors = &clients[..2];
        let first = futures::future::join_all(
            survivors
                .iter()
                .enumerate()
                .map(|(t, c)| train(c, t, 4, 7, |_| {})),
        );
        tokio::time::timeout(Duration::from_secs(30), first)
            .await
            .expect("the survivors are not held back by the failed trainer");
        // ... then a replacement joins at their step (PS-6) and all three finish.
        let new = g.start_rank(4, true).await.expect("the replacement joins");
        let joined = client(&new, 2);
        let at = joined.join().await.unwrap();
        assert_eq!(
            at, 7,
            "the replacement starts at the slowest live trainer's step"
        );
        let runs = [
            (&survivors[0], 0, 7),
            (&survivors[1], 1, 7),
            (&joined, 2, at),
        ];
        futures::future::join_all(runs.map(|(c, t, from)| train(c, t, from, STEPS, |_| {}))).await;
        for (shard, _, _) in SHARDS {
            for holder in [&a[0], &a[1]] {
                let s = collectives::shard_stats(holder, shard).unwrap();
                assert_eq!(s.clocks, vec![STEPS; 3], "shard {shard}");
                assert_eq!(
                    s.applied,
                    vec![STEPS, STEPS, 4 + STEPS - 7],
                    "shard {shard}: the acknowledged pushes"
                );
            }
        }
        let want = expected(|step| {
            if (4..7).contains(&step) {
                vec![0, 1]
            } else {
                vec![0, 1, 2]
            }
        });
        assert_close(&weights(&a[0]).await, &want);
        assert_eq!(
            weights(&a[0]).await,
            weights(&a[1]).await,
            "the primary and the backup of each shard are bit-identical"
        );
        let mut live: Vec<Agent> = a[..4].to_vec();
        live.push(new);
        shutdown_all(&live).await;
        a[4].shutdown_within(Duration::from_secs(1)).await;
    });
}

/// PS-5: a push whose call ends while its change is on the way to the backup (the trainer
/// gives up on it: a deadline, a cancel) is still replicated before it is applied; the
/// trainer's retry is acknowledged once both copies hold it, they are equal, and after the
/// primary fails the backup serves the update. Ranks: 0 the primary, 1 the backup, 2 the
/// trainer; the backup answers replication 1.5 s late.
#[test]
fn a_push_interrupted_on_its_way_to_the_backup_is_not_lost() {
    run(120, async {
        let g = ElasticGroup::start(
            3,
            Transport::Memory(rpc_core::MemoryNetwork::new()),
            registry,
            Duration::from_millis(600),
        )
        .await;
        let a = &g.agents;
        let zero = || vec![Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap()];
        let asp = Consistency::Asp;
        collectives::serve_replica(&a[0], 7, zero(), LR, asp, 1, Replica::Primary { backup: 1 })
            .expect("served");
        collectives::serve_replica(&a[1], 7, zero(), LR, asp, 1, Replica::Backup { primary: 0 })
            .expect("served");
        let c = PsClient::new(&a[2], vec![(0, 7)], 0).with_backups([Some(1)]);
        let grad = || vec![vec![Tensor::new(&[1.0f64, 2.0], &Device::Cpu).unwrap()]];
        c.pull(0).await.unwrap();
        testing::delay_calls(
            &a[1],
            "collectives::ps_replicate",
            Some(Duration::from_millis(1500)),
        );
        // The trainer gives up on the push (its future is dropped: the call is cancelled).
        let first = tokio::time::timeout(Duration::from_millis(300), c.push(0, grad())).await;
        assert!(first.is_err(), "the push was still on its way");
        // Its retry: acknowledged once both copies hold the step.
        c.push(0, grad()).await.unwrap();
        testing::delay_calls(&a[1], "collectives::ps_replicate", None);
        let want = vec![-LR, -2.0 * LR];
        let held = |r: usize| collectives::shard_stats(&a[r], 7).unwrap();
        assert_eq!(held(0).applied, [1], "the primary applied it once");
        assert_eq!(held(1).applied, [1], "the backup holds it");
        // The primary fails: the trainer fails over and the backup serves the update.
        testing::silence(&a[0], true);
        let by = std::time::Instant::now() + Duration::from_secs(10);
        while a[2].is_live(0u32).unwrap() {
            assert!(
                std::time::Instant::now() < by,
                "the primary declared failed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let w = c.pull(1).await.unwrap();
        assert!(c.failed_over(0));
        assert_close(&w[0][0].to_vec1::<f64>().unwrap(), &want);
        for r in futures::future::join_all(a[1..].iter().map(|a| a.shutdown())).await {
            assert_eq!(r.aborted, 0, "{r:?}");
        }
        a[0].shutdown_within(Duration::from_secs(1)).await;
    });
}

//! One copy of a parameter shard: a plain, synchronous state machine over [`Change`]s. The
//! primary [`admits`](Shard::admit) a change (validates it, drops a duplicate, fixes what the
//! backup must repeat), then both copies [`apply`](Shard::apply) it in the same order; nothing
//! here waits or talks to the network (`log.rs` does).

use candle_core::Tensor;
use rpc_core::BoxError;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tokio::sync::watch;

use super::{Consistency, Replica};
use autograd_dist::RTensor;

/// A change of a shard: what the primary applies and forwards to its backup (PS-5).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Change {
    Push {
        trainer: usize,
        rank: u32,
        clock: u64,
        grads: Vec<RTensor>,
    },
    Depart {
        trainer: usize,
        incarnation: u64,
        worker: String,
        cause: String,
    },
    Join {
        trainer: usize,
        rank: u32,
        incarnation: u64,
        at: u64,
    },
}

/// What [`Shard::admit`] decided.
#[derive(Debug)]
pub(crate) enum Admitted {
    /// The shard already holds the change (PS-4): nothing to do; the trainer's clock.
    Held(u64),
    /// The change to apply on both copies, in the form the backup repeats.
    Apply(Change),
}

pub(crate) struct Shard {
    pub params: Vec<Tensor>,
    /// BSP: per step, per trainer, the gradients it pushed for the step, until every live
    /// trainer has (summed then, in trainer order: PS-9).
    pending: HashMap<u64, Vec<Option<Vec<Tensor>>>>,
    lr: f64,
    pub consistency: Consistency,
    pub clocks: Vec<u64>,
    /// Per trainer: steps below this one do not wait for it (PS-6).
    joined_at: Vec<u64>,
    pub applied: Vec<u64>,
    /// The rank each trainer calls from (learned from its calls) and its incarnation.
    pub trainer_ranks: Vec<Option<(u32, u64)>>,
    /// Per trainer: `(worker name, cause)` once declared failed (PS-3).
    pub departed: Vec<Option<(String, String)>>,
    /// Per trainer: the rank whose pushes (or join) hold the index, kept by both copies.
    pushed_by: Vec<Option<u32>>,
    pub max_staleness: u64,
    pub changed: watch::Sender<u64>,
    pub replica: Replica,
}

impl Shard {
    pub(crate) fn new(
        params: Vec<Tensor>,
        lr: f64,
        consistency: Consistency,
        trainers: usize,
        replica: Replica,
    ) -> Self {
        Self {
            params,
            pending: HashMap::new(),
            lr,
            consistency,
            clocks: vec![0; trainers],
            joined_at: vec![0; trainers],
            applied: vec![0; trainers],
            trainer_ranks: vec![None; trainers],
            departed: vec![None; trainers],
            pushed_by: vec![None; trainers],
            max_staleness: 0,
            changed: watch::channel(0).0,
            replica,
        }
    }

    /// The slowest live trainer's clock, leaving out `except` (`None`: no trainer is left).
    pub(crate) fn min_live_clock(&self, except: Option<usize>) -> Option<u64> {
        (0..self.clocks.len())
            .filter(|&t| self.departed[t].is_none() && Some(t) != except)
            .map(|t| self.clocks[t])
            .min()
    }

    /// An error if `trainer` is not one of the shard's or has left it (PS-3).
    pub(crate) fn check_trainer(&self, trainer: usize) -> Result<(), BoxError> {
        match self.departed.get(trainer) {
            None => Err(format!(
                "trainer {trainer} is not one of the shard's {} trainers",
                self.clocks.len()
            )
            .into()),
            Some(Some((worker, cause))) => Err(format!(
                "trainer {trainer} (worker `{worker}`) was declared failed and left the shard: \
                 {cause}"
            )
            .into()),
            Some(None) => Ok(()),
        }
    }

    /// An error if `rank` pushes as `trainer` while another rank's pushes hold that index:
    /// the second of two trainers given one index (its pushes passed for retries of the
    /// first's, acknowledged and never applied). A replacement takes an index over by joining
    /// (PS-6); pulls, which only read, are anyone's.
    fn check_holder(&self, trainer: usize, rank: u32) -> Result<(), BoxError> {
        match self.pushed_by.get(trainer) {
            Some(Some(r)) if *r != rank => Err(format!(
                "trainer {trainer} is rank {r}'s (it pushed as trainer {trainer}), and rank \
                 {rank} pushed as trainer {trainer} too: give each trainer its own index"
            )
            .into()),
            _ => Ok(()),
        }
    }

    /// Whether `change` is new to the shard, and in what form both copies apply it; an error
    /// (nothing applied anywhere) for a change the shard refuses: gradients of the wrong
    /// number, shape, dtype or device, a trainer that is not the shard's or has left it (PS-3), a step
    /// ahead of the trainer's clock (PS-7), a replacement for a live trainer (PS-6).
    pub(crate) fn admit(&self, change: Change) -> Result<Admitted, BoxError> {
        match change {
            Change::Push {
                trainer,
                rank,
                clock,
                ref grads,
            } => {
                if grads.len() != self.params.len() {
                    return Err(format!(
                        "{} gradients for {} parameters",
                        grads.len(),
                        self.params.len()
                    )
                    .into());
                }
                for (i, (p, gr)) in self.params.iter().zip(grads).enumerate() {
                    let why = if p.dims() != gr.dims() {
                        format!("of shape {:?} for one of shape {:?}", gr.dims(), p.dims())
                    } else if p.dtype() != gr.dtype() {
                        let (g, p) = (gr.dtype().as_str(), p.dtype().as_str());
                        format!("of dtype {g} for one of dtype {p}")
                    } else if !p.device().same_device(gr.device()) {
                        let (g, p) = (gr.device().location(), p.device().location());
                        format!("on {g:?} for one on {p:?}")
                    } else {
                        continue;
                    };
                    return Err(format!("gradient {why} (parameter {i})").into());
                }
                self.check_trainer(trainer)?;
                self.check_holder(trainer, rank)?;
                let next = self.clocks[trainer];
                if clock < next {
                    return Ok(Admitted::Held(next));
                }
                if clock > next {
                    return Err(format!(
                        "trainer {trainer} pushed step {clock}, but its next step is {next}: a \
                         step from the future would hold every other trainer back"
                    )
                    .into());
                }
                Ok(Admitted::Apply(change))
            }
            Change::Depart {
                trainer,
                incarnation,
                ..
            } => {
                let known = self.trainer_ranks[trainer].map_or(0, |(_, i)| i);
                if self.departed[trainer].is_some() || incarnation < known {
                    return Ok(Admitted::Held(self.clocks[trainer]));
                }
                Ok(Admitted::Apply(change))
            }
            Change::Join {
                trainer,
                rank,
                incarnation,
                at,
            } => {
                if trainer >= self.clocks.len() {
                    return Err(format!(
                        "trainer {trainer} is not one of the shard's {} trainers",
                        self.clocks.len()
                    )
                    .into());
                }
                if self.departed[trainer].is_none() {
                    if let Some((r, i)) = self.trainer_ranks[trainer] {
                        // PS-8: a newer incarnation of the holder's rank replaces it.
                        if (r, i) != (rank, incarnation) && !(r == rank && i < incarnation) {
                            return Err(format!(
                                "trainer {trainer} is held by live rank {r} (incarnation {i}); \
                                 only a departed trainer can be replaced"
                            )
                            .into());
                        }
                    }
                }
                // Never a step the departed holder pushed (PS-4 holds across incarnations);
                // the backup joins at the step chosen here.
                let at = at
                    .max(self.clocks[trainer])
                    .max(self.min_live_clock(Some(trainer)).unwrap_or(at));
                Ok(Admitted::Apply(Change::Join {
                    trainer,
                    rank,
                    incarnation,
                    at,
                }))
            }
        }
    }

    /// All parameters or none: an error leaves every parameter as it was.
    fn apply_grads(&mut self, grads: Vec<Tensor>) -> candle_core::Result<()> {
        let stepped = self
            .params
            .iter()
            .zip(grads)
            .map(|(p, g)| p - (g * self.lr)?)
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.params = stepped;
        Ok(())
    }

    /// BSP: applies, in step order, every pending step each live trainer has pushed.
    fn settle(&mut self) -> candle_core::Result<()> {
        let mut steps: Vec<u64> = self.pending.keys().copied().collect();
        steps.sort_unstable();
        for c in steps {
            let pushed = &self.pending[&c];
            let complete = (0..pushed.len()).all(|t| {
                pushed[t].is_some() || self.departed[t].is_some() || c < self.joined_at[t]
            });
            if !complete {
                break;
            }
            // PS-9: summed in trainer order, so the result does not depend on arrival order;
            // applied before the step leaves `pending`, so an error loses none of it.
            let mut sum: Option<Vec<Tensor>> = None;
            for g in pushed.iter().flatten() {
                sum = Some(match sum {
                    None => g.clone(),
                    Some(s) => s
                        .iter()
                        .zip(g)
                        .map(|(a, b)| a + b)
                        .collect::<candle_core::Result<_>>()?,
                });
            }
            if let Some(g) = sum {
                self.apply_grads(g)?;
            }
            let pushed = self.pending.remove(&c).unwrap_or_default();
            for (t, g) in pushed.iter().enumerate() {
                self.applied[t] += u64::from(g.is_some());
            }
        }
        Ok(())
    }

    /// Applies `change`, admitted by the primary ([`Shard::admit`]); returns the trainer's
    /// clock after it. Both copies apply the same admitted changes in the same order and
    /// check nothing again: a check that read state only one copy keeps (the ranks trainers
    /// pulled from) could let one copy skip what the other applied.
    pub(crate) fn apply(&mut self, change: Change) -> Result<u64, BoxError> {
        let clock = match change {
            Change::Push {
                trainer,
                rank,
                clock,
                grads,
            } => {
                let incarnation = self.trainer_ranks[trainer].map_or(0, |(_, i)| i);
                self.trainer_ranks[trainer] = Some((rank, incarnation));
                self.pushed_by[trainer] = Some(rank);
                let tensors: Vec<Tensor> = grads.into_iter().map(|g| g.0).collect();
                if self.consistency == Consistency::Bsp {
                    // Every trainer pulled step `clock` from the same state: apply the step's
                    // gradients together, once every live trainer's have arrived.
                    let trainers = self.clocks.len();
                    self.pending
                        .entry(clock)
                        .or_insert_with(|| vec![None; trainers])[trainer] = Some(tensors);
                    self.settle()?;
                } else {
                    self.apply_grads(tensors)?;
                    self.applied[trainer] += 1;
                }
                self.clocks[trainer] = clock + 1;
                clock + 1
            }
            Change::Depart {
                trainer,
                worker,
                cause,
                ..
            } => {
                tracing::warn!(trainer, worker = %worker, "a trainer left the parameter shard");
                self.departed[trainer] = Some((worker, cause));
                self.settle()?;
                self.clocks[trainer]
            }
            Change::Join {
                trainer,
                rank,
                incarnation,
                at,
            } => {
                self.departed[trainer] = None;
                self.trainer_ranks[trainer] = Some((rank, incarnation));
                self.pushed_by[trainer] = Some(rank);
                self.clocks[trainer] = at;
                self.joined_at[trainer] = at;
                self.settle()?;
                tracing::info!(
                    trainer,
                    rank,
                    incarnation,
                    step = at,
                    "a trainer joined the parameter shard"
                );
                at
            }
        };
        self.changed.send_modify(|v| *v += 1);
        Ok(clock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn shard(consistency: Consistency) -> Shard {
        let p = Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
        Shard::new(vec![p], 0.5, consistency, 2, Replica::Sole)
    }

    fn push(trainer: usize, clock: u64, g: [f64; 2]) -> Change {
        Change::Push {
            trainer,
            rank: trainer as u32 + 10,
            clock,
            grads: vec![RTensor(Tensor::new(&g, &Device::Cpu).unwrap())],
        }
    }

    /// The primary's way: admit, then apply what was admitted.
    fn submit(s: &mut Shard, change: Change) -> Result<u64, BoxError> {
        match s.admit(change)? {
            Admitted::Held(clock) => Ok(clock),
            Admitted::Apply(c) => s.apply(c),
        }
    }

    fn params(s: &Shard) -> Vec<f64> {
        s.params[0].to_vec1().unwrap()
    }

    /// PS-4: a push the shard holds is admitted as held and applying it again changes nothing.
    #[test]
    fn a_repeated_push_is_held_not_applied_twice() {
        let mut s = shard(Consistency::Asp);
        assert_eq!(submit(&mut s, push(0, 0, [1.0, 2.0])).unwrap(), 1);
        assert!(matches!(
            s.admit(push(0, 0, [1.0, 2.0])).unwrap(),
            Admitted::Held(1)
        ));
        assert_eq!(submit(&mut s, push(0, 0, [1.0, 2.0])).unwrap(), 1);
        assert_eq!(params(&s), [-0.5, -1.0]);
        assert_eq!(s.applied, [1, 0]);
    }

    /// PS-7: a step ahead of the trainer's clock is refused, naming both, and changes nothing.
    #[test]
    fn a_push_from_the_future_is_refused() {
        let mut s = shard(Consistency::Bsp);
        let e = submit(&mut s, push(1, 1_000_000, [1.0, 1.0])).unwrap_err();
        assert!(
            e.to_string()
                .contains("pushed step 1000000, but its next step is 0"),
            "{e}"
        );
        assert_eq!(s.clocks, [0, 0]);
        assert_eq!(s.applied, [0, 0]);
    }

    /// PS-2: under BSP a step's gradients are applied together once both trainers pushed it.
    #[test]
    fn bsp_applies_a_step_once_every_trainer_pushed_it() {
        let mut s = shard(Consistency::Bsp);
        submit(&mut s, push(0, 0, [1.0, 0.0])).unwrap();
        assert_eq!(params(&s), [0.0, 0.0], "waits for trainer 1");
        submit(&mut s, push(1, 0, [0.0, 4.0])).unwrap();
        assert_eq!(params(&s), [-0.5, -2.0]);
        assert_eq!(s.applied, [1, 1]);
    }

    /// PS-9: under BSP a step's gradients are summed in trainer order, whatever order they
    /// arrived in, so a run's parameters do not depend on timing. With three trainers, f32
    /// addition tells the orders apart: (1e8 + 1) - 1e8 is 0, (1e8 - 1e8) + 1 is 1. Before,
    /// the sum ran in arrival order and the two orders below ended 0.5 apart.
    #[test]
    fn bsp_sums_a_step_in_trainer_order_whatever_the_arrival_order() {
        let params = |order: [usize; 3]| {
            let p = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
            let mut s = Shard::new(vec![p], 0.5, Consistency::Bsp, 3, Replica::Sole);
            let g = [1e8f32, 1.0, -1e8];
            for t in order {
                let push = Change::Push {
                    trainer: t,
                    rank: t as u32 + 10,
                    clock: 0,
                    grads: vec![RTensor(Tensor::new(&[g[t]], &Device::Cpu).unwrap())],
                };
                submit(&mut s, push).unwrap();
            }
            s.params[0].to_vec1::<f32>().unwrap()
        };
        let in_order = params([0, 1, 2]);
        for order in [[0, 2, 1], [2, 1, 0], [1, 0, 2]] {
            assert_eq!(params(order), in_order, "arrival order {order:?}");
        }
    }

    /// PS-6: a join is admitted at the slowest live trainer's step (what the backup repeats);
    /// a live trainer cannot be replaced.
    #[test]
    fn a_join_is_fixed_at_the_slowest_live_step_and_never_takes_a_live_index() {
        let mut s = shard(Consistency::Asp);
        for c in 0..3 {
            submit(&mut s, push(0, c, [0.0, 0.0])).unwrap();
        }
        submit(&mut s, push(1, 0, [0.0, 0.0])).unwrap();
        let e = s
            .admit(Change::Join {
                trainer: 1,
                rank: 99,
                incarnation: 1,
                at: 0,
            })
            .unwrap_err();
        assert!(e.to_string().contains("held by live rank 11"), "{e}");
        submit(
            &mut s,
            Change::Depart {
                trainer: 1,
                incarnation: 0,
                worker: "w".into(),
                cause: "gone".into(),
            },
        )
        .unwrap();
        let Admitted::Apply(Change::Join { at, .. }) = s
            .admit(Change::Join {
                trainer: 1,
                rank: 11,
                incarnation: 1,
                at: 0,
            })
            .unwrap()
        else {
            panic!("a join to a departed index is admitted")
        };
        assert_eq!(at, 3, "the slowest live trainer's step");
    }

    /// PS-8: a newer incarnation of the rank that holds an index may join before the shard
    /// has heard that the old one failed; an older incarnation, or another rank, may not.
    #[test]
    fn a_newer_incarnation_of_the_holder_joins_before_the_verdict() {
        let mut s = shard(Consistency::Bsp);
        submit(&mut s, push(0, 0, [0.0, 0.0])).unwrap();
        submit(&mut s, push(1, 0, [0.0, 0.0])).unwrap();
        let join = |rank, incarnation| Change::Join {
            trainer: 1,
            rank,
            incarnation,
            at: 0,
        };
        submit(&mut s, join(11, 2)).unwrap();
        assert_eq!(s.trainer_ranks[1], Some((11, 2)));
        for (rank, incarnation) in [(11, 1), (12, 3)] {
            let e = s.admit(join(rank, incarnation)).unwrap_err();
            assert!(e.to_string().contains("held by live rank 11"), "{e}");
        }
        // The old incarnation's departure, heard late, changes nothing.
        let late = Change::Depart {
            trainer: 1,
            incarnation: 0,
            worker: "w".into(),
            cause: "gone".into(),
        };
        assert!(matches!(s.admit(late).unwrap(), Admitted::Held(_)));
    }
}

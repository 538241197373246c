//! The buckets of an overlapped pass, learnt from the first one (DDP-2), and which of them
//! may leave before their segment ends (DDP-4).

use std::collections::{HashMap, HashSet};

use candle_core::{Device, Tensor, TensorId};

use super::DistributedDataParallel;
use crate::group::{CollectiveError, ReduceOp};

/// The buckets of an overlapped pass.
#[derive(Debug)]
pub(super) struct Plan {
    /// The pass's cuts.
    pub(super) cuts: usize,
    /// For each segment (by its index in the forward order), the buckets that complete once
    /// it has been backpropagated: first those that may leave before it ends (`early[k]` of
    /// them), then the others.
    pub(super) after: Vec<Vec<Vec<usize>>>,
    /// For each segment, how many of its buckets hold only handed-over parameters.
    pub(super) early: Vec<usize>,
    /// Parameters that got no gradient in the first pass: zeros, sent at the end.
    pub(super) unused: Vec<Vec<usize>>,
    /// The segment whose backward completes each parameter's gradient.
    pub(super) segment_of: HashMap<TensorId, usize>,
    /// Parameters whose whole gradient in the first pass was one product handed over by
    /// `grad_once` while their segment's backward ran (DDP-4).
    pub(super) handed: HashSet<TensorId>,
}

/// DDP-7: a segment whose weights left early (DDP-4) sends what else it completes (biases,
/// norms' scales) with the next segment's buckets when that is under this many bytes: each
/// all-reduce costs its ring's latency however small it is, and a model cut at every layer
/// would otherwise pay it twice per layer.
pub(super) const LEFTOVER_BYTES: usize = 256 << 10;

impl DistributedDataParallel {
    /// DDP-2, one plan for the group: every member's first pass in one all-reduce (the
    /// minimum): each parameter's last segment over the members that gave it a gradient (the
    /// segment after which every member has it; a parameter no member gave one stays
    /// unused), handed over only where it was on every member, and the number of cuts, which
    /// must be the same everywhere. Returns the agreed segments and handed-over parameters.
    pub(super) async fn agree(
        &self,
        cuts: usize,
        last_segment: &HashMap<TensorId, usize>,
        handed: &HashSet<TensorId>,
    ) -> Result<(HashMap<TensorId, usize>, HashSet<TensorId>), CollectiveError> {
        let unused = cuts + 1;
        let ids: Vec<TensorId> = self.vars.iter().map(|v| v.as_tensor().id()).collect();
        let mut mine = vec![cuts as f64, -(cuts as f64)];
        mine.extend(
            ids.iter()
                .map(|id| last_segment.get(id).map_or(unused, |&s| s) as f64),
        );
        mine.extend(
            ids.iter()
                .map(|id| f64::from(u8::from(handed.contains(id)))),
        );
        let n = mine.len();
        let mine = Tensor::from_vec(mine, n, &Device::Cpu)?;
        let all = self.group.all_reduce(&mine, ReduceOp::Min).await?;
        let all = all.to_vec1::<f64>()?;
        let (fewest, most) = (all[0], -all[1]);
        if fewest != most {
            return Err(CollectiveError::Failed {
                op: "ddp backward",
                members: self.group.ranks().to_vec(),
                message: format!(
                    "the members' first passes cut the model differently (from {fewest} to \
                     {most} times): every member must cut it at the same places"
                ),
            });
        }
        let segments = &all[2..2 + ids.len()];
        let handed_everywhere = &all[2 + ids.len()..];
        let agreed = ids
            .iter()
            .zip(segments)
            .filter(|(_, &s)| (s as usize) < unused)
            .map(|(&id, &s)| (id, s as usize))
            .collect();
        let handed = ids
            .iter()
            .zip(handed_everywhere)
            .filter(|(_, &h)| h == 1.0)
            .map(|(&id, _)| id)
            .collect();
        Ok((agreed, handed))
    }

    /// DDP-2: buckets per segment from the last segment in which each parameter got a
    /// gradient, in reverse parameter order, up to `bucket_bytes`, one element type and
    /// device each; within a segment, the handed-over parameters' buckets first (DDP-4).
    /// What a segment with handed-over parameters leaves besides them (its biases, say), if
    /// under [`LEFTOVER_BYTES`], goes with the next segment's buckets (DDP-7).
    pub(super) fn learn_plan(
        &self,
        cuts: usize,
        last_segment: &HashMap<TensorId, usize>,
        handed: HashSet<TensorId>,
    ) -> Plan {
        // The parameters per slot (the segments, then the unused) and kind (handed, other),
        // in reverse order, then each list in buckets.
        let slots = cuts + 2;
        let mut lists: Vec<[Vec<usize>; 2]> = vec![Default::default(); slots];
        for i in (0..self.vars.len()).rev() {
            let id = self.vars[i].as_tensor().id();
            let slot = last_segment.get(&id).copied().unwrap_or(cuts + 1);
            let kind = usize::from(!(slot <= cuts && handed.contains(&id)));
            lists[slot][kind].push(i);
        }
        // DDP-7: backward completes the segments from the last (`cuts`) to the first.
        for slot in (1..=cuts).rev() {
            let [handed, rest] = &mut lists[slot];
            if !handed.is_empty() && !rest.is_empty() && self.bytes(rest) < LEFTOVER_BYTES {
                let mut moved = std::mem::take(rest);
                moved.append(&mut lists[slot - 1][1]);
                lists[slot - 1][1] = moved;
            }
        }
        let full = lists
            .into_iter()
            .map(|kinds| kinds.map(|list| self.fill_buckets(list)));
        let mut after = Vec::with_capacity(cuts + 1);
        let mut early = Vec::with_capacity(cuts + 1);
        let mut unused = Vec::new();
        for (slot, [leaving, waiting]) in full.into_iter().enumerate() {
            if slot <= cuts {
                early.push(leaving.len());
                after.push(leaving.into_iter().chain(waiting).collect());
            } else {
                unused.extend(leaving.into_iter().chain(waiting));
            }
        }
        Plan {
            cuts,
            after,
            early,
            unused,
            segment_of: last_segment.clone(),
            handed,
        }
    }

    /// The bytes of parameters `idx`.
    fn bytes(&self, idx: &[usize]) -> usize {
        (idx.iter())
            .map(|&i| self.vars[i].as_tensor())
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

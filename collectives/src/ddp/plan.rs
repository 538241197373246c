//! The buckets of an overlapped pass, learnt from the first one (DDP-2), and which of them
//! may leave before their segment ends (DDP-4).

use std::collections::{HashMap, HashSet};

use candle_core::TensorId;

use super::DistributedDataParallel;

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

impl DistributedDataParallel {
    /// DDP-2: buckets per segment from the last segment in which each parameter got a
    /// gradient, in reverse parameter order, up to `bucket_bytes`, one element type and
    /// device each; within a segment, the handed-over parameters' buckets first (DDP-4).
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
}

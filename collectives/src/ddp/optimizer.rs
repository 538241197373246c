//! Horovod's `DistributedOptimizer`: a local optimizer whose step backpropagates through an
//! overlapped [`Pass`] and then updates.

use autograd_dist::Optimizer;
use candle_core::Tensor;
use rpc_core::trace::Cat;

use super::{DistributedDataParallel, Pass};
use crate::group::CollectiveError;

impl DistributedDataParallel {
    /// Wraps a local optimizer, Horovod's `DistributedOptimizer` style: its step takes a pass
    /// and its loss, backpropagates with the combination overlapped, and updates.
    pub fn wrap(&self, opt: Optimizer) -> DdpOptimizer<'_> {
        DdpOptimizer { ddp: self, opt }
    }
}

/// A local optimizer whose step overlaps the gradients' combination with backward (Horovod's
/// `DistributedOptimizer`, over [`Pass`]).
pub struct DdpOptimizer<'a> {
    ddp: &'a DistributedDataParallel,
    opt: Optimizer,
}

impl<'a> DdpOptimizer<'a> {
    /// Starts a pass (mark its cuts in the forward pass with [`Pass::cut`]).
    pub fn pass(&self) -> Pass<'a> {
        self.ddp.pass()
    }

    /// Backpropagates `loss` through `pass`, combining gradients over the group as they
    /// come, then updates the parameters (an `optimizer step` span in the trace).
    pub async fn backward_step(
        &mut self,
        pass: Pass<'_>,
        loss: &Tensor,
    ) -> Result<(), CollectiveError> {
        let grads = pass.backward(loss).await?;
        let tracer = self.ddp.group.agent().tracer();
        let _span = tracer.span(Cat::Optimizer, "optimizer step");
        self.opt.step(&grads)?;
        Ok(())
    }

    /// The wrapped optimizer (learning rate, state for checkpoints).
    pub fn optimizer(&mut self) -> &mut Optimizer {
        &mut self.opt
    }
}

//! Errors of distributed autograd.

use rpc_core::RpcError;

/// Why a distributed autograd operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AutogradError {
    /// Local tensor computation failed.
    #[error("tensor operation failed")]
    Candle(#[from] candle_core::Error),
    /// A worker of the graph, or one holding a module or parameters, failed, could not be
    /// reached, or answered an error (the source says which function and why).
    #[error("the call to worker `{worker}` failed")]
    Rpc {
        /// The worker.
        worker: String,
        /// The cause.
        #[source]
        source: Box<RpcError>,
    },
    /// An optimizer could not be set up.
    #[error("optimizer on worker `{worker}`: {message}")]
    Optimizer {
        /// The owner.
        worker: String,
        /// What went wrong.
        message: String,
    },
    /// An optimizer state does not fit the optimizer's parameters, or an operation was
    /// asked of a context or pipeline in a state that does not allow it.
    #[error("{0}")]
    State(String),
    /// A pipeline stage failed its part of a step.
    #[error("pipeline stage {stage} on worker `{worker}` failed")]
    Stage {
        /// The stage's index.
        stage: usize,
        /// Its worker.
        worker: String,
        /// The cause (the pass and micro-batch, where the stage could say).
        #[source]
        source: Box<AutogradError>,
    },
}

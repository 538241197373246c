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
    #[error("{}", rpc_context(worker, source))]
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

/// The context an `Rpc` error adds to its source: the worker, unless the source names it
/// already (most do: "worker `w` failed, ..."), so a chain says it once.
fn rpc_context(worker: &str, source: &RpcError) -> String {
    if source.to_string().contains(&format!("`{worker}`")) {
        "a call of distributed autograd failed".to_owned()
    } else {
        format!("the call to worker `{worker}` failed")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain names the worker once, whether the source names it or not.
    #[test]
    fn a_failed_call_names_its_worker_once() {
        let failed = AutogradError::Rpc {
            worker: "worker1".into(),
            source: Box::new(RpcError::PeerFailed {
                worker: "worker1".into(),
                fn_name: "f".into(),
                cause: "gone".into(),
            }),
        };
        let chain = rpc_core::error_chain(&failed);
        assert_eq!(chain.matches("worker1").count(), 1, "{chain}");
        let blocked = AutogradError::Rpc {
            worker: "worker2".into(),
            source: Box::new(RpcError::CannotBlock { reason: "x" }),
        };
        let chain = rpc_core::error_chain(&blocked);
        assert!(
            chain.contains("the call to worker `worker2` failed"),
            "{chain}"
        );
    }
}

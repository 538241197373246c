//! Incoming connections and calls.
//!
//! The accept loop authenticates each connection (bounded by the handshake timeout) before
//! anything is decoded, then serves it by kind: control connections through `mux.rs`, bulk
//! connections through `bulk.rs`. Each request is polled once on its connection's task; if it
//! has to wait, it becomes a task of its own. There is no fixed pool for nested calls to
//! exhaust, and a handler that finishes at once costs no spawn or thread hand-off. (A handler
//! that computes for long before its first `.await` delays the next request on the same
//! connection, as any blocking code on an async runtime would: move such work to
//! `spawn_blocking`.) Root calls (depth 0) take a permit from a semaphore of
//! `max_concurrent_calls`; calls nested in another call never wait for one, so a chain
//! A→B→A→… of any depth cannot deadlock on the limit.
//!
//! A handler's panic is caught and reported to the caller as a remote error; the worker keeps
//! serving. A result too large for the frame limit is reported as an error instead of breaking
//! the connection for every other call on it.

use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use crate::agent::Agent;
use crate::auth::{self, ConnKind};
use crate::context::{CallContext, Scope, META, NO_DEADLINE, SCOPE};
use crate::error::{RemoteError, RemoteErrorKind};
use crate::transport::{Conn, Listener};
use crate::wire::{CallOk, CallReply, CallRequest};

/// Accepts connections until the agent stops.
pub(crate) async fn accept_loop(agent: Agent, mut listener: Listener) {
    let stop = agent.inner.stop_accepting.clone();
    loop {
        // Biased: once told to stop, a connection waiting in the backlog is not taken.
        let conn = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            c = listener.accept() => c,
        };
        match conn {
            Ok(conn) => {
                let a = agent.clone();
                agent.inner.conns.spawn(async move {
                    let stop = a.inner.stop.clone();
                    tokio::select! {
                        biased;
                        _ = stop.cancelled() => {}
                        _ = serve_conn(a, conn) => {}
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotConnected => break,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(worker = %agent.name(), cause = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_conn(agent: Agent, mut conn: Conn) {
    let inner = &agent.inner;
    let hs = tokio::time::timeout(
        inner.cfg.handshake_timeout,
        auth::server(&mut conn, &inner.cfg.secret),
    )
    .await;
    let (kind, rank) = match hs {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            tracing::warn!(worker = %agent.name(), cause = %e, "refused a connection");
            return;
        }
        Err(_) => {
            tracing::warn!(worker = %agent.name(), "refused a connection: handshake timed out");
            return;
        }
    };
    if rank >= inner.cfg.world_size {
        tracing::warn!(worker = %agent.name(), rank, "refused a connection from a rank outside the group");
        return;
    }
    match kind {
        ConnKind::Control => serve_control(agent, conn, rank).await,
        ConnKind::Bulk => crate::bulk::serve_incoming(&agent, conn, rank).await,
        ConnKind::Sync => match crate::transport::into_std_tcp(conn) {
            Some(stream) => crate::direct::serve(&agent, stream, rank).await,
            None => {
                tracing::warn!(worker = %agent.name(), "refused a sync connection on a transport other than TCP")
            }
        },
        ConnKind::Rendezvous => {
            tracing::warn!(worker = %agent.name(), "refused a rendezvous connection on a worker port")
        }
    }
}

async fn serve_control(agent: Agent, conn: Conn, caller: u32) {
    match crate::mux::serve(agent.clone(), conn, caller).await {
        Ok(()) => tracing::debug!(worker = %agent.name(), caller, "control connection closed"),
        Err(e) => {
            tracing::warn!(worker = %agent.name(), caller, cause = %e, "control connection failed")
        }
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

/// The deadline a request's caller set, if any (one without sends [`NO_DEADLINE`] from its
/// start), as of `now`.
pub(crate) fn callers_deadline(deadline: Instant, now: Instant) -> Option<Instant> {
    (deadline.saturating_duration_since(now) < NO_DEADLINE / 2).then_some(deadline)
}

/// Runs one request to its reply. Not a tracing span: one per request doubled the size of
/// every request's future (each is boxed, and a connection's task may hold thousands); the
/// failures are logged with the function and caller instead.
pub(crate) async fn handle(
    agent: Agent,
    deadline: Option<Instant>,
    req: CallRequest,
    caller: u32,
    cancel: Option<tokio_util::sync::CancellationToken>,
) -> CallReply {
    let inner = &agent.inner;
    inner.spin.touch();
    let fail = |kind, msg: String| RemoteError::new(kind, &req.fn_name, agent.name(), msg);
    if req.depth == 0 && agent.is_stopping() {
        return Err(fail(
            RemoteErrorKind::ShuttingDown,
            "worker is shutting down".into(),
        ));
    }
    let Some(entry) = inner.registry.get(&req.fn_name) else {
        let names = inner.registry.names();
        let shown: Vec<_> = names
            .iter()
            .filter(|n| !n.starts_with("rpc_core::"))
            .take(20)
            .collect();
        return Err(fail(
            RemoteErrorKind::UnknownFunction,
            format!("no function of that name is registered (registered: {shown:?})"),
        ));
    };
    if let Some(keep) = &req.keep {
        if inner.registry.sink(&keep.sink).is_none() {
            // Named as the sink, as a keep call to this worker itself names it.
            return Err(RemoteError::new(
                RemoteErrorKind::UnknownFunction,
                &format!("keep sink `{}`", keep.sink),
                agent.name(),
                format!("no keep sink `{}` is registered here", keep.sink),
            ));
        }
    }
    if entry.sig != req.sig {
        return Err(fail(
            RemoteErrorKind::TypeMismatch,
            format!("callee's `{}` is {}", req.fn_name, entry.signature_text()),
        ));
    }
    // Framework-internal calls (the shutdown barrier) never wait for a permit: they must not
    // queue behind the user calls whose completion they wait for.
    let _permit = if req.depth == 0 && !req.fn_name.starts_with("rpc_core::") {
        match inner.admission.clone().acquire_owned().await {
            Ok(p) => Some(p),
            Err(_) => {
                return Err(fail(
                    RemoteErrorKind::ShuttingDown,
                    "worker is shutting down".into(),
                ))
            }
        }
    } else {
        None
    };
    // Boxed where there are blobs, here and below: a request's future stays small.
    let blobs = if req.blobs.is_empty() {
        Vec::new()
    } else {
        Box::pin(crate::bulk::receive(&agent, caller, req.blobs, deadline))
            .await
            .map_err(|e| fail(RemoteErrorKind::Protocol, e))?
    };
    let ctx = CallContext {
        agent: agent.clone(),
        caller,
        deadline,
        cancel,
    };
    let scope = Scope {
        deadline,
        depth: req.depth + 1,
    };
    let meta = req.meta;
    if let Some(keep) = req.keep {
        let fut = handle_keep(
            &agent,
            &req.fn_name,
            entry,
            ctx,
            scope,
            keep,
            req.payload,
            blobs,
        );
        // Boxed: creating a value is the rarer request, and its state is the larger.
        return Box::pin(META.scope(meta, fut)).await;
    }
    let fut = META.scope(meta, (entry.handler)(ctx, req.payload, blobs));
    let (payload, blobs) = match SCOPE
        .scope(scope, AssertUnwindSafe(fut).catch_unwind())
        .await
    {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return Err(e),
        Err(p) => {
            let msg = panic_message(&*p);
            tracing::error!(worker = %agent.name(), fn_name = %req.fn_name, caller, panic = %msg, "handler panicked");
            return Err(fail(RemoteErrorKind::Panic, msg));
        }
    };
    let blobs = if blobs.is_empty() {
        Vec::new()
    } else {
        Box::pin(crate::bulk::send(&agent, caller, blobs))
            .await
            .map_err(|e| fail(RemoteErrorKind::Protocol, e))?
    };
    let size = payload.len() + crate::bulk::inline_bytes(&blobs);
    if size + 1024 > inner.cfg.max_frame_bytes {
        return Err(fail(
            RemoteErrorKind::Protocol,
            format!(
                "result is {size} bytes, above the frame limit of {}",
                inner.cfg.max_frame_bytes
            ),
        ));
    }
    Ok(CallOk { payload, blobs })
}

/// A keep-call: run the function, hand its typed result (or its error) to the sink.
#[allow(clippy::too_many_arguments)]
async fn handle_keep(
    agent: &Agent,
    fn_name: &str,
    entry: &crate::registry::Entry,
    ctx: CallContext,
    scope: Scope,
    keep: crate::wire::KeepTarget,
    payload: Vec<u8>,
    blobs: Vec<bytes::Bytes>,
) -> CallReply {
    let sink = agent
        .inner
        .registry
        .sink(&keep.sink)
        .cloned()
        .expect("checked before admission");
    let sink_ctx = ctx.clone();
    let fut = (entry.keep)(ctx, payload, blobs);
    let result = match SCOPE
        .scope(scope, AssertUnwindSafe(fut).catch_unwind())
        .await
    {
        Ok(r) => r,
        Err(p) => Err(RemoteError::new(
            RemoteErrorKind::Panic,
            fn_name,
            agent.name(),
            panic_message(&*p),
        )),
    };
    let failed = result.as_ref().err().cloned();
    sink(sink_ctx, keep.token, result)?;
    match failed {
        Some(e) => Err(e),
        None => Ok(CallOk {
            payload: Vec::new(),
            blobs: Vec::new(),
        }),
    }
}

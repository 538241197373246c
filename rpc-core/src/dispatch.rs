//! The callee: one path for every call a worker serves, whether it came from the wire (a
//! multiplexed or a blocking connection, through the network layer's [`Serve`] seam) or from
//! this worker itself (typed, without serialization).
//!
//! Every call is first *checked* ([`check`]): refused while shutting down (root calls from the
//! wire), looked up by name, its keep sink and its signature fingerprint checked; a root call
//! from the wire then waits for a permit of `max_concurrent_calls`. Calls nested in another
//! call never wait for a permit, so a chain A→B→A→… of any depth cannot deadlock on the limit;
//! there is no fixed pool for nested calls to exhaust. Then the function runs *guarded*
//! ([`guarded`]): under its deadline and depth, with a panic caught and reported to the caller
//! as a remote error (the worker keeps serving). A keep-call hands its typed result to the keep
//! sink instead of returning it. A result too large for the frame limit is reported as an
//! error instead of breaking the connection for every other call on it.
//!
//! A handler that computes for long before its first `.await` delays the next request on the
//! same connection, as any blocking code on an async runtime would: move such work to
//! `spawn_blocking`.
//!
//! Cancellation, both sides of it, is `cancel.rs`'s (CAN-1, CAN-2).

use futures::FutureExt;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use std::time::Instant;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::cancel::Cancellable;
use crate::context::{Scope, META, SCOPE};
use crate::error::{BoxError, RemoteError, RemoteErrorKind};
use crate::net::{self, Serve};
use crate::registry::{sig_of, RemoteFn};
use crate::state::Registry;
use crate::state::{CallContext, Callee, Entry, Inner, KeepSink, KeptValue};
use crate::wire::{CallMeta, CallOk, CallReply, CallRequest};

impl Callee {
    /// The callee's state for `registry` (the framework's own functions already in it),
    /// admitting `max_concurrent_calls` root calls at once.
    pub(crate) fn new(registry: Registry, max_concurrent_calls: usize) -> Self {
        Self {
            registry,
            admission: Arc::new(Semaphore::new(max_concurrent_calls)),
            running: Arc::default(),
            delays: Mutex::new(HashMap::new()),
            any_delay: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Delays every call of `fn_name` from the wire by `delay` before its handler runs
    /// (`None`: no longer).
    pub(crate) fn set_delay(&self, fn_name: &str, delay: Option<std::time::Duration>) {
        let mut d = self.delays.lock().unwrap_or_else(|p| p.into_inner());
        match delay {
            Some(t) => d.insert(fn_name.to_owned(), t),
            None => d.remove(fn_name),
        };
        self.any_delay
            .store(!d.is_empty(), std::sync::atomic::Ordering::Relaxed);
    }

    fn delay_of(&self, fn_name: &str) -> Option<std::time::Duration> {
        if !self.any_delay.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let d = self.delays.lock().unwrap_or_else(|p| p.into_inner());
        d.get(fn_name).copied()
    }

    /// No root call is admitted from now on (shutdown phase 3).
    pub(crate) fn close_admission(&self) {
        self.admission.close();
    }
}

impl Serve for Inner {
    fn serve(
        self: &Arc<Self>,
        caller: u32,
        deadline: Option<Instant>,
        req: CallRequest,
    ) -> impl Future<Output = CallReply> + Send + 'static {
        let worker = Arc::clone(self);
        let cancel = req.cancel_id.map(|id| (id, CancellationToken::new()));
        let token = cancel.as_ref().map(|(_, t)| t.clone());
        let calls = &self.callee.running;
        Cancellable::new(
            handle(worker, deadline, req, caller, token),
            cancel.map(|(id, t)| (Arc::clone(calls), (caller, id), t)),
        )
    }

    fn refuse(self: &Arc<Self>, caller: u32, req: &CallRequest, why: String) -> CallReply {
        self.refused(caller, req, why)
    }
}

impl Inner {
    /// See [`Serve::refuse`].
    fn refused(&self, caller: u32, req: &CallRequest, why: String) -> CallReply {
        let me = &self.group.worker(self.group.rank()).name;
        let from = &self.group.worker(caller).name;
        tracing::warn!(worker = %me, fn_name = %req.fn_name, caller = %from, %why, "call refused");
        Err(RemoteError::new(
            RemoteErrorKind::Busy,
            &req.fn_name,
            me,
            format!("refused the call from `{from}` at once: {why}"),
        ))
    }
}

/// Internal: the caller dropped call `id`.
pub(crate) struct CancelCall;

impl RemoteFn for CancelCall {
    const NAME: &'static str = "rpc_core::cancel";
    type Args = (u64,);
    type Output = ();
    async fn call(ctx: CallContext, (id,): (u64,)) -> Result<(), BoxError> {
        ctx.agent.inner.callee.running.cancel(ctx.caller, id);
        Ok(())
    }
}

/// Where a call comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A request read from a connection.
    Wire,
    /// A call this worker made to itself (its caller already refused a root call once
    /// shutdown began, AG-3, and local calls take no permit).
    Local,
}

/// A call that passed the callee's checks.
struct Checked<'a> {
    entry: &'a Entry,
    sink: Option<&'a KeepSink>,
    /// A root call from the wire: it takes a permit of `max_concurrent_calls`.
    needs_permit: bool,
}

/// The callee's checks, in order: shutting down (root calls from the wire), the function's
/// name, the keep sink's name, the signature. A root call from the wire then takes a permit;
/// framework-internal calls (the shutdown barrier, cancels) never wait for one:
/// they must not queue behind the user calls whose completion they wait for.
fn check<'a>(
    w: &'a Arc<Inner>,
    origin: Origin,
    fn_name: &str,
    sig: u64,
    depth: u32,
    sink: Option<&str>,
) -> Result<Checked<'a>, RemoteError> {
    let callee = &w.callee;
    let fail = |kind, msg: String| RemoteError::new(kind, fn_name, w.name(), msg);
    let wire_root = origin == Origin::Wire && depth == 0;
    if wire_root && w.life.is_stopping() {
        return Err(shutting_down(w, fn_name));
    }
    let Some(entry) = callee.registry.get(fn_name) else {
        let names = callee.registry.names();
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
    let sink = match sink {
        None => None,
        Some(name) => Some(callee.registry.sink(name).ok_or_else(|| {
            // Named as the sink.
            RemoteError::new(
                RemoteErrorKind::UnknownFunction,
                &format!("keep sink `{name}`"),
                w.name(),
                format!("no keep sink `{name}` is registered here"),
            )
        })?),
    };
    if entry.sig != sig {
        return Err(fail(
            RemoteErrorKind::TypeMismatch,
            format!("callee's `{fn_name}` is {}", entry.signature_text()),
        ));
    }
    Ok(Checked {
        entry,
        sink,
        needs_permit: wire_root && !fn_name.starts_with("rpc_core::"),
    })
}

fn shutting_down(w: &Inner, fn_name: &str) -> RemoteError {
    RemoteError::new(
        RemoteErrorKind::ShuttingDown,
        fn_name,
        w.name(),
        "worker is shutting down",
    )
}

/// `fut` run under `scope`, a panic caught and reported as a remote error. (Not an `async
/// fn`: it would hold `fut` twice, and a request's future is allocated for every request.)
fn guarded<'a, T: 'a>(
    scope: Scope,
    fut: impl Future<Output = Result<T, RemoteError>> + 'a,
    w: &'a Arc<Inner>,
    fn_name: &'a str,
    caller: u32,
) -> impl Future<Output = Result<T, RemoteError>> + 'a {
    SCOPE
        .scope(scope, AssertUnwindSafe(fut).catch_unwind())
        .map(move |r| match r {
            Ok(r) => r,
            Err(p) => {
                let msg = panic_message(&*p);
                tracing::error!(
                    worker = %w.name(), %fn_name, caller, panic = %msg, "handler panicked"
                );
                Err(RemoteError::new(
                    RemoteErrorKind::Panic,
                    fn_name,
                    w.name(),
                    msg,
                ))
            }
        })
}

/// Hands a keep-call's result (or its failure) to the sink; the call's answer is the failure,
/// or the sink's own.
fn hand_to_sink(
    sink: &KeepSink,
    ctx: CallContext,
    token: Vec<u8>,
    result: Result<KeptValue, RemoteError>,
) -> Result<(), RemoteError> {
    let failed = result.as_ref().err().cloned();
    sink(ctx, token, result)?;
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A request from the wire, run to its reply. Not a tracing span: one per request doubled the
/// size of every request's future (each is boxed, and a connection's task may hold
/// thousands); the failures are logged with the function and caller instead. (Not an `async
/// fn`: it would hold the request twice, as a parameter and as the local it is moved into.)
fn handle(
    w: Arc<Inner>,
    deadline: Option<Instant>,
    req: CallRequest,
    caller: u32,
    cancel: Option<CancellationToken>,
) -> impl Future<Output = CallReply> + Send + 'static {
    let CallRequest {
        fn_name,
        sig,
        depth,
        payload,
        blobs,
        keep,
        meta,
        cancel_id: _,
        trace,
    } = req;
    // The served span starts now and is opened once the function is known, named by the
    // registry's static name (no allocation per call).
    let served = Served {
        flow: trace,
        arrived: w.net.tracer.now(),
        bytes: (payload.len() + net::inline_bytes(&blobs)) as u64,
    };
    run_request(
        w, deadline, fn_name, sig, depth, payload, blobs, keep, meta, caller, cancel, served,
    )
}

/// What the trace's served span of a request needs from its arrival.
struct Served {
    flow: Option<u64>,
    arrived: Option<u64>,
    bytes: u64,
}

/// [`handle`]'s body: the checks, the permit, the handler, the reply's blobs. (In the form
/// of `handle`, whose future size this one's is measured with.)
#[allow(clippy::too_many_arguments, clippy::manual_async_fn)]
fn run_request(
    w: Arc<Inner>,
    deadline: Option<Instant>,
    fn_name: std::borrow::Cow<'static, str>,
    sig: u64,
    depth: u32,
    payload: Vec<u8>,
    blobs: Vec<crate::wire::WireBlob>,
    keep: Option<crate::wire::KeepTarget>,
    meta: crate::wire::CallMeta,
    caller: u32,
    cancel: Option<CancellationToken>,
    served: Served,
) -> impl Future<Output = CallReply> + Send + 'static {
    async move {
        let fn_name = &*fn_name;
        let fail = |kind, msg: String| RemoteError::new(kind, fn_name, w.name(), msg);
        let sink_name = keep.as_ref().map(|k| &*k.sink);
        // A refused call has no served span: its caller's says why.
        let checked = check(&w, Origin::Wire, fn_name, sig, depth, sink_name)?;
        let tracer = &w.net.tracer;
        let mut span = tracer.call_served(checked.entry.name, caller, served.flow, served.arrived);
        span.bytes(served.bytes);
        let reply = async {
            let callee = &w.callee;
            let _permit = match checked.needs_permit {
                true => Some(
                    Arc::clone(&callee.admission)
                        .acquire_owned()
                        .await
                        .map_err(|_| shutting_down(&w, fn_name))?,
                ),
                false => None,
            };
            if let Some(d) = callee.delay_of(fn_name) {
                Box::pin(tokio::time::sleep(d)).await;
            }
            let net = &w.net;
            // Boxed where there are blobs, here and below: a request's future stays small.
            let blobs = if blobs.is_empty() {
                Vec::new()
            } else {
                let bytes = Some(net::bulk_bytes(&blobs));
                let _span = net.tracer.transfer("receive arguments", caller, bytes);
                Box::pin(net.bulk.receive(caller, blobs, deadline))
                    .await
                    .map_err(|e| fail(RemoteErrorKind::Protocol, e))?
            };
            let ctx = CallContext::new(&w, caller, deadline, cancel);
            let scope = Scope {
                deadline,
                depth: depth.saturating_add(1),
            };
            let entry = checked.entry;
            if let (Some(keep), Some(sink)) = (keep, checked.sink) {
                // Boxed: creating a value is the rarer request, and its state is the larger.
                let fut = async {
                    let run = (entry.keep)(ctx.clone(), payload, blobs);
                    let result = guarded(scope, run, &w, fn_name, caller).await;
                    hand_to_sink(sink, ctx, keep.token, result)
                };
                Box::pin(META.scope(meta, fut)).await?;
                return Ok(CallOk {
                    payload: Vec::new(),
                    blobs: Vec::new(),
                });
            }
            let run = META.scope(meta, (entry.handler)(ctx, payload, blobs));
            let (payload, blobs) = guarded(scope, run, &w, fn_name, caller).await?;
            let blobs = if blobs.is_empty() {
                Vec::new()
            } else {
                let _span = net.tracer.transfer("send result", caller, None);
                Box::pin(net.bulk.send(caller, blobs))
                    .await
                    .map_err(|e| fail(RemoteErrorKind::Protocol, e))?
            };
            let size = payload.len() + net::inline_bytes(&blobs);
            let limit = net.cfg.max_frame_bytes;
            if !net::fits(size, limit) {
                return Err(fail(
                    RemoteErrorKind::Protocol,
                    format!("result is {size} bytes, above the frame limit of {limit}"),
                ));
            }
            Ok(CallOk { payload, blobs })
        }
        .await;
        span.ok(reply.is_ok());
        reply
    }
}

/// `F` run here for this worker itself, typed (AG-1): the checks and guards of a request
/// from the wire, with `meta` as its call metadata. The checks are made now.
pub(crate) fn call_local<'a, F: RemoteFn>(
    w: &'a Arc<Inner>,
    args: F::Args,
    deadline: Option<Instant>,
    depth: u32,
    meta: CallMeta,
) -> Result<impl Future<Output = Result<F::Output, RemoteError>> + Send + 'a, RemoteError> {
    check(w, Origin::Local, F::NAME, sig_of::<F>(), depth, None)?;
    Ok(run_typed::<F>(w, args, deadline, depth, meta))
}

/// `F` run here under its scope and `meta`, panics caught.
fn run_typed<'a, F: RemoteFn>(
    w: &'a Arc<Inner>,
    args: F::Args,
    deadline: Option<Instant>,
    depth: u32,
    meta: CallMeta,
) -> impl Future<Output = Result<F::Output, RemoteError>> + Send + 'a {
    let me = w.rank();
    let ctx = CallContext::new(w, me, deadline, None);
    let scope = Scope {
        deadline,
        depth: depth.saturating_add(1),
    };
    let run = META.scope(meta, async move {
        // Boxed and type-erased: a function that calls itself (directly or through a peer)
        // would otherwise have an infinitely sized future.
        let fut: Pin<Box<dyn Future<Output = Result<F::Output, BoxError>> + Send>> =
            Box::pin(F::call(ctx, args));
        fut.await
            .map_err(|e| RemoteError::from_error(RemoteErrorKind::Handler, F::NAME, w.name(), &*e))
    });
    guarded(scope, run, w, F::NAME, me)
}

/// A keep-call to this worker itself: `F` run here as [`call_local`] runs it, its result
/// handed to the keep sink `sink` with `token`. The checks are made now.
pub(crate) fn keep_local<'a, F: RemoteFn>(
    w: &'a Arc<Inner>,
    args: F::Args,
    deadline: Option<Instant>,
    depth: u32,
    meta: CallMeta,
    sink: &str,
    token: Vec<u8>,
) -> Result<impl Future<Output = Result<(), RemoteError>> + Send + 'a, RemoteError> {
    let checked = check(w, Origin::Local, F::NAME, sig_of::<F>(), depth, Some(sink))?;
    let sink = checked.sink.expect("checked with a sink");
    let ctx = CallContext::new(w, w.rank(), deadline, None);
    let run = run_typed::<F>(w, args, deadline, depth, meta.clone());
    Ok(run.map(move |result| {
        let result = result.map(KeptValue::new);
        META.sync_scope(meta, || hand_to_sink(sink, ctx, token, result))
    }))
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

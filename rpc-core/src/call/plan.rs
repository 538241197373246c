//! What a call will do, decided when it is made: its target, deadline and depth, and (for
//! another worker) its encoded arguments and envelope.

use std::time::{Duration, Instant};

use std::sync::Arc;

use crate::blob;
use crate::context::{current_meta, current_scope, Scope};
use crate::error::RpcError;
use crate::group::ToWorker;
use crate::net::{self, NO_DEADLINE};
use crate::registry::{sig_of, RemoteFn};
use crate::state::Inner;
use crate::state::{MessageContext, MessageKind};
use crate::wire::{CallMeta, CallRequest, KeepTarget, WireBlob, WorkerId};

/// When a call must end, how deeply it is nested, and when it was made.
#[derive(Clone, Copy, Debug)]
pub(super) struct Timing {
    /// The earliest of its own timeout and the deadline of the call it is nested in (AG-2).
    pub deadline: Option<Instant>,
    pub depth: u32,
    pub started: Instant,
}

impl Timing {
    /// The deadline, or one [`NO_DEADLINE`] from the start.
    pub(super) fn deadline_or_far(&self) -> Instant {
        self.deadline.unwrap_or(self.started + NO_DEADLINE)
    }
}

/// A call to another worker, encoded where it was made.
pub(super) struct Outgoing {
    pub to: u32,
    pub payload: Vec<u8>,
    pub blobs: Vec<bytes::Bytes>,
    /// What the arguments lent, given back unless the request is marked sent.
    pub unsent: blob::Unsent,
    /// What the envelope carries: the caller's metadata as the providers adjust it for `to`.
    pub meta: CallMeta,
    /// The caller's metadata itself, in effect while the reply is decoded.
    pub caller_meta: CallMeta,
    pub timing: Timing,
}

/// A call as planned when it is made: to another worker (encoded, or why not) with its
/// arguments, or to this one with its arguments and its caller's metadata.
pub(super) enum Plan<A> {
    Remote(Result<Outgoing, RpcError>, A),
    Local(Result<(u32, Timing), RpcError>, A, CallMeta),
}

/// Plans a call of `F` to `to`. A call to another worker is encoded here, in its caller's
/// context (its call metadata, the moment of the call), so its future only sends and waits;
/// its arguments stay alive in it until the call ends, as they would in the caller.
pub(super) fn plan<F: RemoteFn>(
    w: &Arc<Inner>,
    to: &impl ToWorker,
    args: F::Args,
    timeout: Duration,
) -> Plan<F::Args> {
    let planned = w
        .group
        .resolve(to)
        .and_then(|to| Ok((to, timing::<F>(w, timeout, current_scope())?)));
    match planned {
        Ok((to, _)) if w.net.membership.is_failed(to) => {
            let e = peer_failed::<F>(w, to);
            Plan::Remote(Err(e.expect("declared failed")), args)
        }
        Ok((to, _)) if w.net.membership.has_left(to) => {
            let e = RpcError::PeerLeft {
                worker: w.group.worker(to).name.clone(),
                fn_name: F::NAME.to_owned(),
            };
            Plan::Remote(Err(e), args)
        }
        Ok((to, timing)) if to != w.rank() => {
            Plan::Remote(prepare::<F>(w, to, &args, timing), args)
        }
        other => Plan::Local(other, args, current_meta()),
    }
}

/// A call to another worker (`to`), its arguments encoded.
fn prepare<F: RemoteFn>(
    w: &Arc<Inner>,
    to: u32,
    args: &F::Args,
    timing: Timing,
) -> Result<Outgoing, RpcError> {
    let (payload, blobs, unsent) = encode_args::<F>(w, to, args)?;
    Ok(Outgoing {
        to,
        payload,
        blobs,
        unsent,
        meta: w.layers.outgoing_meta(crate::context::current_meta(), to),
        caller_meta: current_meta(),
        timing,
    })
}

/// A call's [`Timing`]; refused once the agent is closed, or for a root call once shutdown
/// has begun (AG-3; the framework's own calls, the barrier and cancels, still go).
pub(super) fn timing<F: RemoteFn>(
    w: &Arc<Inner>,
    timeout: Duration,
    scope: Option<Scope>,
) -> Result<Timing, RpcError> {
    let started = Instant::now();
    let own = (!timeout.is_zero()).then(|| started + timeout.min(NO_DEADLINE));
    let inherited = scope.and_then(|s| s.deadline);
    let deadline = match (own, inherited) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let depth = scope.map_or(0, |s| s.depth);
    let life = &w.life;
    if let Some(signal) = life.signalled.get() {
        if depth == 0 && !F::NAME.starts_with("rpc_core::") {
            return Err(RpcError::Stopped {
                worker: w.name().to_owned(),
                fn_name: F::NAME.to_owned(),
                signal: (*signal).to_owned(),
            });
        }
    }
    if life.is_closed() || (depth == 0 && life.is_stopping() && !F::NAME.starts_with("rpc_core::"))
    {
        return Err(RpcError::Shutdown {
            worker: w.name().to_owned(),
            fn_name: F::NAME.to_owned(),
        });
    }
    Ok(Timing {
        deadline,
        depth,
        started,
    })
}

/// Encodes a call's arguments for `to`: the payload, its blobs, and what they lent (given
/// back unless the request is marked sent).
pub(super) fn encode_args<F: RemoteFn>(
    w: &Arc<Inner>,
    to: u32,
    args: &F::Args,
) -> Result<(Vec<u8>, Vec<bytes::Bytes>, blob::Unsent), RpcError> {
    let msg = MessageContext::for_worker(w, WorkerId(to), MessageKind::Request);
    let (encoded, lent) = blob::encode_request(args, Some(msg));
    let unsent = blob::Unsent::new(lent);
    match encoded {
        Ok((payload, blobs)) => Ok((payload, blobs, unsent)),
        Err(source) => Err(RpcError::Encode {
            what: "arguments",
            fn_name: F::NAME.to_owned(),
            source,
        }),
    }
}

/// Refuses a request that would exceed the frame limit.
pub(super) fn check_frame<F: RemoteFn>(
    w: &Arc<Inner>,
    payload: &[u8],
    blobs: &[WireBlob],
) -> Result<(), RpcError> {
    let size = payload.len() + net::inline_bytes(blobs) + F::NAME.len();
    let limit = w.net.cfg.max_frame_bytes;
    if !net::fits(size, limit) {
        return Err(RpcError::TooLarge {
            fn_name: F::NAME.to_owned(),
            size,
            limit,
        });
    }
    Ok(())
}

/// The envelope of a call of `F`.
pub(super) fn envelope<F: RemoteFn>(
    depth: u32,
    payload: Vec<u8>,
    blobs: Vec<WireBlob>,
    keep: Option<KeepTarget>,
    meta: CallMeta,
    cancel_id: Option<u64>,
    trace: Option<u64>,
) -> CallRequest {
    CallRequest {
        fn_name: std::borrow::Cow::Borrowed(F::NAME),
        sig: sig_of::<F>(),
        depth,
        payload,
        blobs,
        keep,
        meta,
        cancel_id,
        trace,
    }
}

/// The error of a call of `F` to `to` if `to` was declared failed.
pub(super) fn peer_failed<F: RemoteFn>(w: &Arc<Inner>, to: u32) -> Option<RpcError> {
    let f = w.net.membership.failure(to)?;
    Some(RpcError::PeerFailed {
        worker: f.name,
        fn_name: F::NAME.to_owned(),
        cause: f.cause,
    })
}

/// The error of a call of `F` to `to` whose connection failed, if the group knows why: `to`
/// was declared failed, or it shut down (its detector said it was leaving).
pub(super) fn peer_gone<F: RemoteFn>(w: &Arc<Inner>, to: u32) -> Option<RpcError> {
    peer_failed::<F>(w, to).or_else(|| {
        (w.net.membership.state(to) == crate::net::PeerState::Quiet).then(|| {
            RpcError::PeerShutDown {
                worker: w.group.worker(to).name.clone(),
                fn_name: F::NAME.to_owned(),
            }
        })
    })
}

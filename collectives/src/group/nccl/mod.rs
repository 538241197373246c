//! NCCL for tensors on CUDA devices (the `nccl` feature): all-reduce, broadcast, all-gather,
//! reduce-scatter, reduce and gather of a tensor on a GPU run through NCCL on that device's stream (candle's,
//! so they are ordered with the kernels that produced the tensor), instead of through host
//! memory and the ring over RPC. Tensors on the CPU keep the ring; the choice is made per
//! call, by the tensor's device.
//!
//! - NC-1: one communicator per group and device, made on first use and after a failure:
//!   the group's first member makes NCCL's unique id and sends it to the others over RPC
//!   (the group's own messages); every member joins with its position in the group. Members
//!   agree on keeping or rebuilding it, and on the new one's number, from the generations
//!   they exchange (`generation.rs`), so members that went apart agree again.
//! - NC-2: members agree before NCCL sees a buffer: every operation first exchanges, over
//!   RPC, its header (shape, dtype) and the communicator each member holds, so a mismatch
//!   fails on every member with one message (COL-1) instead of NCCL reading past a buffer,
//!   and a member that lost its communicator makes every member build a new one.
//! - NC-3: operations reach NCCL in the order they were called (a turn taken at the call,
//!   the same order on every member, as the group's sequence numbers), asynchronous ones
//!   included; NCCL deadlocks when two members enqueue in different orders.
//! - NC-4: no wait without bound: an enqueued operation is polled (its completion event and
//!   NCCL's asynchronous error) until it completes, a member of the group is declared
//!   failed (COL-2), or the RPC timeout passes; then the communicator is aborted (NCCL's way
//!   of ending a collective that cannot complete) and the operation fails on this member
//!   naming the cause. Joining a communicator is bounded by the same timeout.
//! - NC-5: NCCL needs one GPU per member (two members on one GPU fail its join with "invalid
//!   usage"). The exchange of NC-2 also names each member's GPU (its UUID); where two members
//!   share one, every member sees it and the operation runs through host memory and the ring
//!   instead, under a sequence number of its own ([`shared_seq`]), its result put back on the
//!   tensor's GPU. So a job may place several workers on one GPU (two shards on `cuda:0`).
//!
//! Layout: this file the communicators, the turns and one operation's life (`run`); `ops.rs`
//! the operations. Scatter and all-to-all of CUDA tensors go through host memory and the
//! ring's messages (a receiver passes no tensor, so nothing says it wants a GPU buffer).

use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::{sys as cu, CudaStream, DevicePtr};
use cudarc::nccl::{result as nc, sys as ncs};
use rpc_core::ext::AgentExt;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::op::Op;
use super::{CollectiveError, ProcessGroup, ReduceOp};

mod ops;
use crate::mailbox::{effective_timeout, mailbox};

/// A raw communicator, aborted when the last operation using it lets go.
struct Comm {
    raw: ncs::ncclComm_t,
    stream: Arc<CudaStream>,
    generation: u64,
}

// SAFETY: an NCCL communicator may be used from any thread; this module enqueues on it from
// one operation at a time (NC-3) and aborts it only once no operation holds it.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `raw` came from ncclCommInitRank and is released once, here.
        if let Err(e) = unsafe { nc::comm_abort(self.raw) } {
            tracing::warn!(code = ?e.0, "ncclCommAbort failed");
        }
    }
}

/// The order in which operations of one group reach NCCL (NC-3).
#[derive(Default)]
struct Turns {
    issued: u64,
    next: u64,
    /// Turns ended out of order (an operation that failed before its turn came).
    done: BTreeSet<u64>,
}

#[derive(Default)]
struct Slot {
    comm: Option<Arc<Comm>>,
    turns: Turns,
}

/// Every group's NCCL state on this worker.
#[derive(Default)]
struct State {
    slots: Mutex<HashMap<u64, Slot>>,
    turned: tokio::sync::Notify,
}

fn state(g: &ProcessGroup) -> Arc<State> {
    g.agent().extension(State::default)
}

/// An operation's place in its group's order (NC-3); ends its turn when dropped.
pub(crate) struct Turn {
    state: Arc<State>,
    group: u64,
    n: u64,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut slots = self.state.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get_mut(&self.group) {
            let t = &mut slot.turns;
            t.done.insert(self.n);
            while t.done.remove(&t.next) {
                t.next += 1;
            }
        }
        drop(slots);
        self.state.turned.notify_waiters();
    }
}

/// The turn of a collective on `t` when it goes through NCCL (a CUDA tensor), taken now.
pub(crate) fn turn(g: &ProcessGroup, t: &Tensor) -> Option<Turn> {
    if !t.device().is_cuda() || g.size() == 1 {
        return None;
    }
    let state = state(g);
    let n = {
        let mut slots = state.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = slots.entry(g.id).or_default();
        slot.turns.issued += 1;
        slot.turns.issued - 1
    };
    Some(Turn {
        state,
        group: g.id,
        n,
    })
}

impl Turn {
    async fn wait(&self) {
        loop {
            let notified = self.state.turned.notified();
            {
                let slots = self.state.slots.lock().unwrap_or_else(|p| p.into_inner());
                if slots
                    .get(&self.group)
                    .is_some_and(|s| s.turns.next == self.n)
                {
                    return;
                }
            }
            notified.await;
        }
    }
}

fn nccl_type(o: &Op<'_>, d: DType) -> Result<ncs::ncclDataType_t, CollectiveError> {
    use ncs::ncclDataType_t as T;
    Ok(match d {
        DType::U8 => T::ncclUint8,
        DType::U32 => T::ncclUint32,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        other => return Err(o.failed(format!("NCCL has no type for {other:?} tensors"))),
    })
}

fn nccl_op(op: ReduceOp) -> ncs::ncclRedOp_t {
    use ncs::ncclRedOp_t as R;
    match op {
        ReduceOp::Sum => R::ncclSum,
        ReduceOp::Mean => R::ncclAvg,
        ReduceOp::Max => R::ncclMax,
        ReduceOp::Min => R::ncclMin,
        ReduceOp::Product => R::ncclProd,
    }
}

fn nccl_err(o: &Op<'_>, what: &str, e: nc::NcclError) -> CollectiveError {
    // SAFETY: ncclGetErrorString returns a static string for any result code.
    let text = unsafe { std::ffi::CStr::from_ptr(ncs::ncclGetErrorString(e.0)) };
    o.failed(format!("{what} failed: {}", text.to_string_lossy()))
}

/// The device address of `t`'s first element (`t` contiguous, on a CUDA device).
fn address(t: &Tensor, stream: &CudaStream) -> candle_core::Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        candle_core::bail!("tensor is not on a CUDA device")
    };
    let start = layout.start_offset();
    macro_rules! at {
        ($t:ty) => {{
            let view = cs.as_cuda_slice::<$t>()?.slice(start..);
            let (p, sync) = view.device_ptr(stream);
            drop(sync);
            p
        }};
    }
    Ok(match t.dtype() {
        DType::U8 => at!(u8),
        DType::U32 => at!(u32),
        DType::I32 => at!(i32),
        DType::I64 => at!(i64),
        DType::F16 => at!(half::f16),
        DType::BF16 => at!(half::bf16),
        DType::F32 => at!(f32),
        DType::F64 => at!(f64),
        other => candle_core::bail!("NCCL has no type for {other:?} tensors"),
    })
}

/// How an operation that was to go through NCCL ran.
#[must_use]
enum Ran {
    /// Through NCCL.
    Nccl,
    /// Not at all: two members share a GPU (NC-5); the caller runs the ring through host
    /// memory under [`shared_seq`].
    SharedGpu,
}

/// NC-5: the sequence number of the ring that replaces NCCL operation `seq`; the high bit
/// keeps it apart from every number a group gives its operations.
fn shared_seq(seq: u64) -> u64 {
    seq | 1 << 63
}

/// NC-5: `t` on the CPU, for the ring.
fn to_host(t: &Tensor) -> Result<Tensor, CollectiveError> {
    Ok(t.to_device(&Device::Cpu)?)
}

/// The UUID of the GPU behind `cuda`, as two integers (what NC-2's exchange carries).
fn gpu_id(o: &Op<'_>, cuda: &candle_core::CudaDevice) -> Result<[i64; 2], CollectiveError> {
    let uuid = cuda
        .cuda_stream()
        .context()
        .uuid()
        .map_err(|e| o.failed(format!("reading the GPU's UUID failed: {e}")))?;
    let b: Vec<u8> = uuid.bytes.iter().map(|&c| c as u8).collect();
    let half = |r: std::ops::Range<usize>| {
        i64::from_le_bytes(b[r].try_into().expect("8 bytes of a 16-byte UUID"))
    };
    Ok([half(0..8), half(8..16)])
}

/// One NCCL operation: agree (NC-2, NC-5), join or reuse the communicator (NC-1), wait for
/// the turn (NC-3), enqueue, wait for completion within bounds (NC-4).
async fn run(
    g: &ProcessGroup,
    o: &Op<'_>,
    turn: Turn,
    device: &Device,
    enqueue: impl FnOnce(ncs::ncclComm_t, &CudaStream) -> Result<(), CollectiveError>,
) -> Result<Ran, CollectiveError> {
    let cuda = device.as_cuda_device()?;
    let state = Arc::clone(&turn.state);
    let held = {
        let slots = state.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.get(&g.id).and_then(|s| s.comm.clone())
    };
    let mine = held.as_ref().map_or(0, |c| c.generation);
    // NC-2: headers (checked by every receive), generations and GPUs, to and from every
    // member.
    let gpu = gpu_id(o, cuda)?;
    let token = Tensor::new(&[mine as i64, gpu[0], gpu[1]], &Device::Cpu)?;
    let others: Vec<u32> = g
        .ranks
        .iter()
        .copied()
        .filter(|&r| r != g.agent().rank())
        .collect();
    let sends = others.iter().map(|&r| o.send(r, 0, token.clone()));
    futures::future::try_join_all(sends).await?;
    let mut theirs = Vec::with_capacity(others.len());
    let mut gpus = vec![gpu];
    for &r in &others {
        let got: Vec<i64> = o.recv(r, 0).await?.to_vec1()?;
        theirs.push(got.first().map_or(0, |&g| g.max(0) as u64));
        if let [_, a, b] = got[..] {
            gpus.push([a, b]);
        }
    }
    // NC-5: every member has every member's GPU, so all of them decide alike.
    gpus.sort_unstable();
    if gpus.windows(2).any(|w| w[0] == w[1]) {
        return Ok(Ran::SharedGpu);
    }
    let comm = match (held, super::generation::agree(mine, &theirs)) {
        (Some(c), None) => c,
        (held, agreed) => {
            state
                .slots
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(g.id)
                .or_default()
                .comm = None;
            drop(held);
            let generation = agreed.unwrap_or(mine + 1);
            join(g, o, &state, (cuda.cuda_stream(), generation)).await?
        }
    };
    turn.wait().await;
    enqueue(comm.raw, &comm.stream)?;
    let done = comm
        .stream
        .record_event(None)
        .map_err(|e| o.failed(format!("{e}")))?;
    let deadline = Instant::now() + effective_timeout(g.agent());
    let mut pause = Duration::from_micros(20);
    drop(turn);
    loop {
        // SAFETY: the event is alive for the call.
        match unsafe { cu::cuEventQuery(done.cu_event()) } {
            cu::cudaError_enum::CUDA_SUCCESS => return Ok(Ran::Nccl),
            cu::cudaError_enum::CUDA_ERROR_NOT_READY => {}
            other => {
                return Err(abort(
                    g,
                    &state,
                    o,
                    format!("the CUDA stream failed: {other:?}"),
                ))
            }
        }
        let mut async_err = ncs::ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is alive (`comm` holds it).
        unsafe { ncs::ncclCommGetAsyncError(comm.raw, &mut async_err) };
        if async_err != ncs::ncclResult_t::ncclSuccess {
            let e = nccl_err(o, "NCCL", nc::NcclError(async_err));
            return Err(abort(g, &state, o, e.to_string()));
        }
        if let Some(doom) = mailbox(g.agent()).group_doomed(g.id) {
            return Err(abort(g, &state, o, doom));
        }
        if Instant::now() >= deadline {
            return Err(abort(g, &state, o, "timed out waiting for NCCL".into()));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}

/// NC-4: drops the communicator (aborted once no operation holds it) and names the cause.
fn abort(g: &ProcessGroup, state: &State, o: &Op<'_>, why: String) -> CollectiveError {
    let mut slots = state.slots.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(slot) = slots.get_mut(&g.id) {
        slot.comm = None;
    }
    o.failed(format!("{why}; the group's NCCL communicator was aborted"))
}

/// NC-1: the first member's unique id to every member, then every member joins.
async fn join(
    g: &ProcessGroup,
    o: &Op<'_>,
    state: &State,
    (stream, generation): (Arc<CudaStream>, u64),
) -> Result<Arc<Comm>, CollectiveError> {
    let leader = g.ranks[0];
    let id = if g.agent().rank() == leader {
        let id = nc::get_uniqueid().map_err(|e| nccl_err(o, "ncclGetUniqueId", e))?;
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        let t = Tensor::new(bytes.as_slice(), &Device::Cpu)?;
        let sends = g.ranks[1..].iter().map(|&r| o.send(r, 1, t.clone()));
        futures::future::try_join_all(sends).await?;
        id
    } else {
        let bytes: Vec<u8> = o.recv(leader, 1).await?.to_vec1()?;
        let mut id = ncs::ncclUniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        id
    };
    let (n, me) = (g.size() as i32, o.me as i32);
    let ctx = Arc::clone(stream.context());
    let joining = tokio::task::spawn_blocking(move || {
        ctx.bind_to_thread().map_err(|e| format!("{e}"))?;
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: `raw` is written by NCCL on success and read only then.
        unsafe { nc::comm_init_rank(raw.as_mut_ptr(), n, id, me) }
            .map(|_| unsafe { raw.assume_init() } as usize)
            .map_err(|e| {
                // SAFETY: a static string for any result code.
                let s = unsafe { std::ffi::CStr::from_ptr(ncs::ncclGetErrorString(e.0)) };
                s.to_string_lossy().into_owned()
            })
    });
    let raw = match tokio::time::timeout(effective_timeout(g.agent()), joining).await {
        Ok(Ok(Ok(raw))) => raw as ncs::ncclComm_t,
        Ok(Ok(Err(e))) => return Err(o.failed(format!("ncclCommInitRank failed: {e}"))),
        Ok(Err(e)) => return Err(o.failed(format!("ncclCommInitRank panicked: {e}"))),
        Err(_) => return Err(o.failed("timed out joining the NCCL communicator".into())),
    };
    let mut slots = state.slots.lock().unwrap_or_else(|p| p.into_inner());
    let slot = slots.entry(g.id).or_default();
    let comm = Arc::new(Comm {
        raw,
        stream,
        generation,
    });
    slot.comm = Some(Arc::clone(&comm));
    Ok(comm)
}

//! The collectives of CUDA tensors through NCCL, each one [`run`]: the buffers made, the
//! NCCL call enqueued on the communicator's stream.

use candle_core::Tensor;
use cudarc::nccl::result as nc;

use super::{address, nccl_err, nccl_op, nccl_type, run, Turn};
use crate::group::op::Op;
use crate::group::{CollectiveError, ProcessGroup, ReduceOp};

impl ProcessGroup {
    fn nccl_begin(
        &self,
        name: &'static str,
        t: &Tensor,
        seq: u64,
    ) -> Result<Op<'_>, CollectiveError> {
        self.begin_at(name, t, seq)
    }

    /// All-reduce of a CUDA tensor through NCCL.
    pub(in crate::group) async fn nccl_all_reduce(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let o = self.nccl_begin("all_reduce", t, seq)?;
        let out = async {
            let t = t.contiguous()?;
            let (ty, red) = (nccl_type(&o, t.dtype())?, nccl_op(op));
            let out = t.zeros_like()?;
            let n = t.elem_count();
            run(self, &o, turn, t.device(), |comm, stream| {
                let (src, dst) = (address(&t, stream)?, address(&out, stream)?);
                // SAFETY: both buffers hold `n` elements of `ty` on the communicator's device.
                unsafe {
                    nc::all_reduce(
                        src as _,
                        dst as _,
                        n,
                        ty,
                        red,
                        comm,
                        stream.cu_stream() as _,
                    )
                }
                .map(drop)
                .map_err(|e| nccl_err(&o, "ncclAllReduce", e))
            })
            .await?;
            Ok(out)
        }
        .await;
        self.end(&o);
        out
    }

    /// Broadcast of a CUDA tensor through NCCL.
    pub(in crate::group) async fn nccl_broadcast(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
        root: u32,
    ) -> Result<Tensor, CollectiveError> {
        let o = self.nccl_begin("broadcast", t, seq)?;
        let out = async {
            let Some(at) = self.ranks.iter().position(|&r| r == root) else {
                return Err(o.failed(format!("root {root} is not a member")));
            };
            let t = t.contiguous()?;
            let ty = nccl_type(&o, t.dtype())?;
            let out = t.zeros_like()?;
            let n = t.elem_count();
            run(self, &o, turn, t.device(), |comm, stream| {
                let (src, dst) = (address(&t, stream)?, address(&out, stream)?);
                // SAFETY: both buffers hold `n` elements of `ty` on the communicator's device.
                unsafe {
                    nc::broadcast(
                        src as _,
                        dst as _,
                        n,
                        ty,
                        at as i32,
                        comm,
                        stream.cu_stream() as _,
                    )
                }
                .map(drop)
                .map_err(|e| nccl_err(&o, "ncclBroadcast", e))
            })
            .await?;
            Ok(out)
        }
        .await;
        self.end(&o);
        out
    }

    /// All-gather of a CUDA tensor through NCCL: one buffer, viewed per member.
    pub(in crate::group) async fn nccl_all_gather(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        let o = self.nccl_begin("all_gather", t, seq)?;
        let out = async {
            let t = t.contiguous()?;
            let ty = nccl_type(&o, t.dtype())?;
            let mut dims = vec![self.size()];
            dims.extend_from_slice(t.dims());
            let all = Tensor::zeros(dims, t.dtype(), t.device())?;
            let n = t.elem_count();
            run(self, &o, turn, t.device(), |comm, stream| {
                let (src, dst) = (address(&t, stream)?, address(&all, stream)?);
                // SAFETY: `all` holds `size * n` elements of `ty`, `t` holds `n`.
                unsafe { nc::all_gather(src as _, dst as _, n, ty, comm, stream.cu_stream() as _) }
                    .map(drop)
                    .map_err(|e| nccl_err(&o, "ncclAllGather", e))
            })
            .await?;
            (0..self.size())
                .map(|i| Ok(all.get(i)?))
                .collect::<Result<Vec<_>, CollectiveError>>()
        }
        .await;
        self.end(&o);
        out
    }

    /// Reduce-scatter of a CUDA tensor through NCCL: this member's chunk of the flattened
    /// result, chunked as the ring chunks (sizes differ by at most one element). NCCL's
    /// reduce-scatter needs equal chunks; otherwise the whole tensor is all-reduced and the
    /// chunk taken (twice the bytes, the same result).
    pub(in crate::group) async fn nccl_reduce_scatter(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let (len, n) = (t.elem_count(), self.size());
        if len % n != 0 {
            let me = self
                .ranks
                .iter()
                .position(|&r| r == self.agent.rank())
                .unwrap_or(0);
            let (base, extra) = (len / n, len % n);
            let start = me * base + me.min(extra);
            let all = self.nccl_all_reduce(seq, turn, t, op).await?;
            return Ok(all
                .flatten_all()?
                .narrow(0, start, base + usize::from(me < extra))?);
        }
        let o = self.nccl_begin("reduce_scatter", t, seq)?;
        let out = async {
            let t = t.contiguous()?;
            let (ty, red) = (nccl_type(&o, t.dtype())?, nccl_op(op));
            let per = len / self.size();
            let out = Tensor::zeros(per, t.dtype(), t.device())?;
            run(self, &o, turn, t.device(), |comm, stream| {
                let (src, dst) = (address(&t, stream)?, address(&out, stream)?);
                // SAFETY: `t` holds `size * per` elements of `ty`, `out` holds `per`.
                unsafe {
                    nc::reduce_scatter(
                        src as _,
                        dst as _,
                        per,
                        ty,
                        red,
                        comm,
                        stream.cu_stream() as _,
                    )
                }
                .map(drop)
                .map_err(|e| nccl_err(&o, "ncclReduceScatter", e))
            })
            .await?;
            Ok(out)
        }
        .await;
        self.end(&o);
        out
    }

    /// Reduce of a CUDA tensor onto `root` through NCCL.
    pub(in crate::group) async fn nccl_reduce(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
        op: ReduceOp,
        root: u32,
    ) -> Result<Option<Tensor>, CollectiveError> {
        let o = self.nccl_begin("reduce", t, seq)?;
        let out = async {
            let Some(at) = self.ranks.iter().position(|&r| r == root) else {
                return Err(o.failed(format!("root {root} is not a member")));
            };
            let t = t.contiguous()?;
            let (ty, red) = (nccl_type(&o, t.dtype())?, nccl_op(op));
            let out = t.zeros_like()?;
            let n = t.elem_count();
            run(self, &o, turn, t.device(), |comm, stream| {
                let (src, dst) = (address(&t, stream)?, address(&out, stream)?);
                let s = stream.cu_stream() as _;
                // SAFETY: both buffers hold `n` elements of `ty` on the communicator's device.
                unsafe { nc::reduce(src as _, dst as _, n, ty, red, at as i32, comm, s) }
                    .map(drop)
                    .map_err(|e| nccl_err(&o, "ncclReduce", e))
            })
            .await?;
            Ok((self.agent.rank() == root).then_some(out))
        }
        .await;
        self.end(&o);
        out
    }

    /// Gather of CUDA tensors onto `root` through NCCL (point-to-point sends and receives in
    /// one NCCL group): one buffer on the root, viewed per member.
    pub(in crate::group) async fn nccl_gather(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
        root: u32,
    ) -> Result<Option<Vec<Tensor>>, CollectiveError> {
        let o = self.nccl_begin("gather", t, seq)?;
        let out = async {
            let Some(at) = self.ranks.iter().position(|&r| r == root) else {
                return Err(o.failed(format!("root {root} is not a member")));
            };
            let t = t.contiguous()?;
            let ty = nccl_type(&o, t.dtype())?;
            let n = t.elem_count();
            let mine = self.agent.rank() == root;
            let mut dims = vec![self.size()];
            dims.extend_from_slice(t.dims());
            let all = match mine {
                true => Some(Tensor::zeros(dims, t.dtype(), t.device())?),
                false => None,
            };
            let size = t.dtype().size_in_bytes() * n;
            run(self, &o, turn, t.device(), |comm, stream| {
                let src = address(&t, stream)?;
                let s = stream.cu_stream() as _;
                let fail = |e| nccl_err(&o, "a gather's send or receive", e);
                nc::group_start().map_err(fail)?;
                let posted = if let Some(all) = &all {
                    let dst = address(all, stream)?;
                    (0..self.size())
                        .try_for_each(|i| {
                            let slot = dst + (i * size) as u64;
                            // SAFETY: slot `i` of `all` holds `n` elements of `ty`; the root's own
                            // slot is filled by a send to itself, as NCCL allows.
                            unsafe { nc::recv(slot as _, n, ty, i as i32, comm, s) }.map(drop)
                        })
                        .and_then(|()| unsafe { nc::send(src as _, n, ty, at as i32, comm, s) })
                } else {
                    // SAFETY: `t` holds `n` elements of `ty`.
                    unsafe { nc::send(src as _, n, ty, at as i32, comm, s) }
                };
                let ended = nc::group_end();
                posted.map_err(fail)?;
                ended.map(drop).map_err(fail)
            })
            .await?;
            let Some(all) = all else {
                return Ok(None);
            };
            (0..self.size())
                .map(|i| Ok(all.get(i)?))
                .collect::<Result<Vec<_>, CollectiveError>>()
                .map(Some)
        }
        .await;
        self.end(&o);
        out
    }
}

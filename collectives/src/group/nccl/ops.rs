//! The collectives of CUDA tensors through NCCL, each one [`run`]: the buffers made, the
//! NCCL call enqueued on the communicator's stream; where members share a GPU (NC-5), the
//! ring's operation on the tensor's host copy instead, its result put back on the GPU.

use candle_core::Tensor;
use cudarc::nccl::{result as nc, sys as ncs};

use super::{address, nccl_err, nccl_op, nccl_type, run, shared_seq, to_host, Ran, Turn};
use crate::group::op::Op;
use crate::group::{CollectiveError, ProcessGroup, ReduceOp};

/// What an NCCL call of one source and one destination buffer is given ([`ProcessGroup::one_call`]
/// made both: `count` elements of `ty` in the source, as many as the call writes in the
/// destination).
struct Call {
    src: u64,
    dst: u64,
    count: usize,
    ty: ncs::ncclDataType_t,
    comm: ncs::ncclComm_t,
    stream: ncs::cudaStream_t,
}

type Status = Result<nc::NcclStatus, nc::NcclError>;

impl ProcessGroup {
    /// `root`'s position in the group (0 for a root that is not a member, which
    /// [`Op::check_root`] fails everywhere before NCCL is called).
    fn position_of(&self, root: u32) -> usize {
        self.ranks.iter().position(|&r| r == root).unwrap_or(0)
    }

    /// One operation `o` of one NCCL call (`what`, for errors) from `t` into a new tensor of
    /// `out_dims` on `t`'s device: `count` is the count the call is given. `None`: members
    /// share a GPU, and the caller runs the ring (NC-5). NC-2's exchange of headers compares
    /// every member's call with every other's, its reduction and root included (COL-1,
    /// ROOT-1).
    async fn one_call(
        &self,
        (o, turn): (Op<'_>, Turn),
        t: &Tensor,
        (out_dims, count): (Vec<usize>, usize),
        what: &'static str,
        call: impl FnOnce(Call) -> Status,
    ) -> Result<Option<Tensor>, CollectiveError> {
        let out = async {
            if let Some(root) = o.header.call.root {
                o.check_root(root).await?;
            }
            let t = t.contiguous()?;
            let ty = nccl_type(&o, t.dtype())?;
            let out = Tensor::zeros(out_dims, t.dtype(), t.device())?;
            let ran = run(self, &o, turn, t.device(), |comm, stream| {
                let (src, dst) = (address(&t, stream)?, address(&out, stream)?);
                let stream = stream.cu_stream() as _;
                call(Call {
                    src,
                    dst,
                    count,
                    ty,
                    comm,
                    stream,
                })
                .map(drop)
                .map_err(|e| nccl_err(&o, what, e))
            })
            .await?;
            Ok(matches!(ran, Ran::Nccl).then_some(out))
        }
        .await;
        self.end(&o);
        out
    }

    /// All-reduce of a CUDA tensor through NCCL.
    pub(in crate::group) async fn nccl_all_reduce(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let (dims, red) = ((t.dims().to_vec(), t.elem_count()), nccl_op(op));
        let o = self.begin_at("all_reduce", t, seq)?.reducing(op);
        let out = self.one_call((o, turn), t, dims, "ncclAllReduce", |c| {
            // SAFETY: both buffers hold `count` elements of `ty` on the communicator's device.
            unsafe {
                let (src, dst) = (c.src as _, c.dst as _);
                nc::all_reduce(src, dst, c.count, c.ty, red, c.comm, c.stream)
            }
        });
        if let Some(out) = out.await? {
            return Ok(out);
        }
        let host = to_host(t)?;
        let o = self
            .begin_at("all_reduce", &host, shared_seq(seq))?
            .reducing(op);
        let out = self.ring_all_reduce(&o, &host, op).await;
        self.end(&o);
        Ok(out?.to_device(t.device())?)
    }

    /// Broadcast of a CUDA tensor through NCCL.
    pub(in crate::group) async fn nccl_broadcast(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
        root: u32,
    ) -> Result<Tensor, CollectiveError> {
        let at = self.position_of(root) as i32;
        let dims = (t.dims().to_vec(), t.elem_count());
        let o = self.begin_at("broadcast", t, seq)?.rooted(root);
        let out = self.one_call((o, turn), t, dims, "ncclBroadcast", |c| {
            // SAFETY: both buffers hold `count` elements of `ty` on the communicator's device.
            unsafe {
                let (src, dst) = (c.src as _, c.dst as _);
                nc::broadcast(src, dst, c.count, c.ty, at, c.comm, c.stream)
            }
        });
        if let Some(out) = out.await? {
            return Ok(out);
        }
        let out = self
            .broadcast_at(&to_host(t)?, root, shared_seq(seq))
            .await?;
        Ok(out.to_device(t.device())?)
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
        let at = self.position_of(root) as i32;
        let (dims, red) = ((t.dims().to_vec(), t.elem_count()), nccl_op(op));
        let o = self.begin_at("reduce", t, seq)?.reducing(op).rooted(root);
        let out = self.one_call((o, turn), t, dims, "ncclReduce", |c| {
            // SAFETY: both buffers hold `count` elements of `ty` on the communicator's device.
            unsafe {
                let (src, dst) = (c.src as _, c.dst as _);
                nc::reduce(src, dst, c.count, c.ty, red, at, c.comm, c.stream)
            }
        });
        let Some(out) = out.await? else {
            let out = self
                .reduce_at(&to_host(t)?, op, root, shared_seq(seq))
                .await?;
            return Ok(out.map(|r| r.to_device(t.device())).transpose()?);
        };
        Ok((self.agent.rank() == root).then_some(out))
    }

    /// All-gather of a CUDA tensor through NCCL: one buffer, viewed per member.
    pub(in crate::group) async fn nccl_all_gather(
        &self,
        seq: u64,
        turn: Turn,
        t: &Tensor,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        let mut dims = vec![self.size()];
        dims.extend_from_slice(t.dims());
        let o = self.begin_at("all_gather", t, seq)?;
        let Some(all) = self
            .one_call((o, turn), t, (dims, t.elem_count()), "ncclAllGather", |c| {
                // SAFETY: the destination holds `size * count` elements of `ty`, the source
                // `count`.
                unsafe { nc::all_gather(c.src as _, c.dst as _, c.count, c.ty, c.comm, c.stream) }
            })
            .await?
        else {
            let all = self.all_gather_at(&to_host(t)?, shared_seq(seq)).await?;
            return all
                .into_iter()
                .map(|p| Ok(p.to_device(t.device())?))
                .collect();
        };
        (0..self.size()).map(|i| Ok(all.get(i)?)).collect()
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
        let (per, red) = (len / n, nccl_op(op));
        let o = self.begin_at("reduce_scatter", t, seq)?.reducing(op);
        let out = self.one_call((o, turn), t, (vec![per], per), "ncclReduceScatter", |c| {
            // SAFETY: the source holds `size * count` elements of `ty`, the destination `count`.
            unsafe {
                let (src, dst) = (c.src as _, c.dst as _);
                nc::reduce_scatter(src, dst, c.count, c.ty, red, c.comm, c.stream)
            }
        });
        if let Some(out) = out.await? {
            return Ok(out);
        }
        let out = self
            .reduce_scatter_at(&to_host(t)?, op, shared_seq(seq))
            .await?;
        Ok(out.to_device(t.device())?)
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
        let at = self.position_of(root);
        let o = self.begin_at("gather", t, seq)?.rooted(root);
        let out = async {
            o.check_root(root).await?;
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
            let ran = run(self, &o, turn, t.device(), |comm, stream| {
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
            if let Ran::SharedGpu = ran {
                return Ok(None);
            }
            let Some(all) = all else {
                return Ok(Some(None));
            };
            (0..self.size())
                .map(|i| Ok(all.get(i)?))
                .collect::<Result<Vec<_>, CollectiveError>>()
                .map(|all| Some(Some(all)))
        }
        .await;
        self.end(&o);
        // `None`: members share a GPU (NC-5), so the ring's gather of the host copies.
        if let Some(out) = out? {
            return Ok(out);
        }
        let all = self.gather_at(&to_host(t)?, root, shared_seq(seq)).await?;
        Ok(all
            .map(|all| all.into_iter().map(|p| p.to_device(t.device())).collect())
            .transpose()?)
    }
}

//! The ring algorithms: all-reduce (reduce-scatter then all-gather, on tensors or, on the CPU,
//! on raw elements in pieces that pipeline across steps), reduce-scatter, all-gather and
//! broadcast.

use candle_core::{DType, Tensor};

use super::element::Element;
use super::lanes::Lanes;
use super::op::{check_len, Op};
use super::{CollectiveError, ProcessGroup, ReduceOp};
use crate::mailbox::P2pError;

fn combine(op: ReduceOp, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match op {
        ReduceOp::Max => a.maximum(b),
        ReduceOp::Min => a.minimum(b),
        _ if a.dtype().is_int() && a.device().is_cpu() => wrapping(op, a, b),
        ReduceOp::Sum | ReduceOp::Mean => a + b,
        ReduceOp::Product => a * b,
    }
}

/// An integer sum or product on the CPU that wraps on overflow, as PyTorch's and NCCL's do
/// (candle's CPU arithmetic is checked in a debug build, and panicked mid-operation).
fn wrapping(op: ReduceOp, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    fn go<T: candle_core::WithDType>(
        a: &Tensor,
        b: &Tensor,
        f: impl Fn(T, T) -> T,
    ) -> candle_core::Result<Tensor> {
        let (x, y) = (
            a.flatten_all()?.to_vec1::<T>()?,
            b.flatten_all()?.to_vec1::<T>()?,
        );
        if x.len() != y.len() {
            candle_core::bail!("combining {} elements with {}", x.len(), y.len());
        }
        let out: Vec<T> = x.into_iter().zip(y).map(|(x, y)| f(x, y)).collect();
        Tensor::from_vec(out, a.dims(), a.device())
    }
    macro_rules! by_dtype {
        ($($d:ident => $t:ty),*) => {
            match (a.dtype(), op) {
                $(
                    (DType::$d, ReduceOp::Product) => go::<$t>(a, b, <$t>::wrapping_mul),
                    (DType::$d, _) => go::<$t>(a, b, <$t>::wrapping_add),
                )*
                (_, ReduceOp::Product) => a * b,
                _ => a + b,
            }
        };
    }
    by_dtype!(U8 => u8, U32 => u32, I16 => i16, I32 => i32, I64 => i64)
}

/// Bytes per message of the fast ring: big enough to amortize a message, small enough that
/// building one piece overlaps with the receiver reducing the previous one. Measured on 2
/// cores at 64 MiB: through shared memory 8 and 16 MiB pieces are within noise of each other
/// and 4 MiB slower with 4 ranks; over TCP 16 MiB beat whole chunks and 4 MiB pieces.
const PIECE_BYTES: usize = 8 << 20;
/// Pieces per ring step that the step numbering leaves room for (chunks up to 256 GiB).
const MAX_PIECES: u32 = 1 << 16;

/// A CPU tensor's elements in a fresh buffer (from [`rpc_core::ext::large_vec`]).
fn copy_out<T: Element>(t: &Tensor) -> candle_core::Result<Vec<T>> {
    let t = t.flatten_all()?.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return t.to_vec1::<T>();
    };
    let all = T::cpu_storage_as_slice(cpu)?;
    let Some((a, b)) = layout.contiguous_offsets() else {
        return t.to_vec1::<T>();
    };
    let mut v = rpc_core::ext::large_vec::<T>(b - a);
    v.extend_from_slice(&all[a..b]);
    Ok(v)
}

impl ProcessGroup {
    pub(super) async fn ring_all_reduce(
        &self,
        o: &Op<'_>,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let n = o.n();
        if n == 1 {
            return Ok(t.clone());
        }
        if matches!(t.device(), candle_core::Device::Cpu) {
            match t.dtype() {
                DType::F32 => return self.ring_flat::<f32>(o, t, op).await,
                DType::F64 => return self.ring_flat::<f64>(o, t, op).await,
                DType::BF16 => return self.ring_flat::<half::bf16>(o, t, op).await,
                DType::F16 => return self.ring_flat::<half::f16>(o, t, op).await,
                _ => {}
            }
        }
        let mut chunks = self.split(t, n)?;
        self.reduce_scatter_steps(o, &mut chunks, op).await?;
        self.all_gather_steps(o, &mut chunks, n as u32 - 1).await?;
        let mut out = Tensor::cat(&chunks, 0)?.reshape(t.dims())?;
        if op == ReduceOp::Mean {
            out = mean_of(out, n)?;
        }
        Ok(out)
    }

    /// The fast ring for CPU floats: one flat buffer, chunks sent as raw elements, received
    /// chunks reduced in place straight from the receive buffer, the result built from the
    /// buffer without a copy.
    pub(super) async fn ring_flat<T: Element>(
        &self,
        o: &Op<'_>,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, CollectiveError> {
        let mut buf: Vec<T> = copy_out(t)?;
        self.ring_slice(o, &mut buf, op).await?;
        Ok(Tensor::from_vec(buf, t.dims(), t.device())?)
    }

    /// The ring over a flat buffer, in place (`Mean` divides at the end).
    ///
    /// `2(n - 1)` steps; at step `s` each member sends one chunk to the next member and
    /// receives one from the previous, and the chunk received at step `s` is the one sent at
    /// step `s + 1`. So the ring runs as a pipeline of pieces (of [`PIECE_BYTES`]): each piece
    /// received is folded and sent on at once, while later pieces are still travelling. In the
    /// reduce-scatter steps before the last, the sum is written straight into the outgoing
    /// blob (in shared memory with a peer on this host) and never into `buf`: those chunks are
    /// overwritten by the all-gather anyway; that saves two of the five passes over the data
    /// that a fold followed by a copy would make. The other steps fill `buf` and the outgoing
    /// piece in one pass ([`Element::fold_tee`]). Each pass runs on the group's lanes
    /// (`lanes.rs`).
    pub(super) async fn ring_slice<T: Element>(
        &self,
        o: &Op<'_>,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let n = o.n();
        let (base, extra) = (buf.len() / n, buf.len() % n);
        let mut ranges = Vec::with_capacity(n);
        let mut start = 0;
        for i in 0..n {
            let size = base + usize::from(i < extra);
            ranges.push(start..start + size);
            start += size;
        }
        let (next, prev) = (o.peer(1), o.peer(-1));
        let steps = 2 * (n - 1);
        // Reduce-scatter steps come first; in both phases the chunk sent at step `s + 1` is
        // the one received at step `s`.
        let received = |s: usize| {
            let back = if s < n - 1 { s + 2 } else { s - (n - 1) + 1 };
            (o.me + 2 * n - back) % n
        };
        let per = (PIECE_BYTES / std::mem::size_of::<T>()).max(1);
        let elem = std::mem::size_of::<T>();
        let lanes = Lanes(self.lanes);
        let tag = |s: usize, j: usize| s as u32 * MAX_PIECES + j as u32;
        let stage = |len: usize, fill: &mut dyn FnMut(&mut [u8])| {
            o.g.agent.blob_for(next, len, fill).map_err(|e| {
                o.exchange_err(P2pError::Send {
                    worker: o.g.agent.name_of(next),
                    source: Box::new(e),
                })
            })
        };
        let send = |s: usize, j: usize, blob: rpc_core::Blob| {
            o.send_raw(next, tag(s, j), blob.into_bytes())
        };
        use futures::StreamExt as _;
        let mut sending = futures::stream::FuturesUnordered::new();
        // Step 0 sends this member's own copy of the chunk before the one it receives first.
        let first = ranges[(o.me + n - 1) % n].clone();
        for (j, p) in buf[first].chunks(per).enumerate() {
            let blob = stage(std::mem::size_of_val(p), &mut |d| lanes.write(p, d))?;
            sending.push(send(0, j, blob));
        }
        let tracer = o.g.agent.tracer();
        for s in 0..steps {
            let phase = if s < n - 1 {
                "reduce-scatter step"
            } else {
                "all-gather step"
            };
            let mut step_span = tracer.span(rpc_core::trace::Cat::Collective, phase);
            step_span.detail(|| format!("{} of {steps}, to rank {next}", s + 1));
            let r = ranges[received(s)].clone();
            step_span.bytes((r.len() * elem) as u64);
            for (j, lo) in r.clone().step_by(per).enumerate() {
                let hi = (lo + per).min(r.end);
                let recv = o.recv_raw(prev, tag(s, j));
                tokio::pin!(recv);
                // Sends in flight make progress while this member waits.
                let got = loop {
                    tokio::select! {
                        got = &mut recv => break got?,
                        Some(sent) = sending.next() => sent?,
                    }
                };
                check_len::<T>(o, hi - lo, got.len())?;
                let got: &[u8] = &got;
                let bytes = (hi - lo) * elem;
                if s + 2 < n {
                    // Reduce-scatter before its last step: the sum goes out, not into `buf`.
                    let mine = &buf[lo..hi];
                    let blob = stage(bytes, &mut |d| lanes.fold(op, mine, got, d))?;
                    sending.push(send(s + 1, j, blob));
                    continue;
                }
                let fold = (s < n - 1).then_some(op);
                if s + 1 < steps {
                    // Into `buf` and into the outgoing piece in one pass.
                    let mine = &mut buf[lo..hi];
                    let blob = stage(bytes, &mut |d| lanes.fold_tee(fold, mine, got, d))?;
                    sending.push(send(s + 1, j, blob));
                } else {
                    lanes.copy(&mut buf[lo..hi], got);
                }
            }
        }
        while let Some(sent) = sending.next().await {
            sent?;
        }
        if op == ReduceOp::Mean {
            lanes.divide(buf, n);
        }
        Ok(())
    }

    /// `n` chunks of the flattened tensor, sizes differing by at most one element.
    pub(super) fn split(&self, t: &Tensor, n: usize) -> candle_core::Result<Vec<Tensor>> {
        let flat = t.flatten_all()?;
        let len = flat.elem_count();
        let (base, extra) = (len / n, len % n);
        let mut start = 0;
        (0..n)
            .map(|i| {
                let size = base + usize::from(i < extra);
                let c = flat.narrow(0, start, size);
                start += size;
                c
            })
            .collect()
    }

    /// After these steps member `i` holds the fully reduced chunk `i`.
    pub(super) async fn reduce_scatter_steps(
        &self,
        o: &Op<'_>,
        chunks: &mut [Tensor],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let n = o.n();
        let (next, prev) = (o.peer(1), o.peer(-1));
        for s in 0..n - 1 {
            let send_idx = (o.me + 2 * n - s - 1) % n;
            let recv_idx = (o.me + 2 * n - s - 2) % n;
            let (sent, got) = tokio::join!(
                o.send(next, s as u32, chunks[send_idx].clone()),
                o.recv(prev, s as u32)
            );
            sent?;
            chunks[recv_idx] = combine(op, &chunks[recv_idx], &got?)?;
        }
        Ok(())
    }

    /// Circulates the chunks: after these steps every member holds every chunk.
    pub(super) async fn all_gather_steps(
        &self,
        o: &Op<'_>,
        chunks: &mut [Tensor],
        first_step: u32,
    ) -> Result<(), CollectiveError> {
        let n = o.n();
        let (next, prev) = (o.peer(1), o.peer(-1));
        for s in 0..n - 1 {
            let send_idx = (o.me + n - s) % n;
            let recv_idx = (o.me + 2 * n - s - 1) % n;
            let step = first_step + s as u32;
            let (sent, got) = tokio::join!(
                o.send(next, step, chunks[send_idx].clone()),
                o.recv(prev, step)
            );
            sent?;
            chunks[recv_idx] = got?;
        }
        Ok(())
    }

    pub(super) async fn reduce_scatter_at(
        &self,
        t: &Tensor,
        op: ReduceOp,
        seq: u64,
    ) -> Result<Tensor, CollectiveError> {
        let o = self.begin_at("reduce_scatter", t, seq)?.reducing(op);
        let out = async {
            let n = o.n();
            let mut chunks = self.split(t, n)?;
            if n > 1 {
                self.reduce_scatter_steps(&o, &mut chunks, op).await?;
            }
            let mine = chunks.swap_remove(o.me);
            Ok(if op == ReduceOp::Mean {
                mean_of(mine, n)?
            } else {
                mine
            })
        }
        .await;
        self.end(&o);
        out
    }

    pub(super) async fn all_gather_at(
        &self,
        t: &Tensor,
        seq: u64,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        let o = self.begin_at("all_gather", t, seq)?;
        let out = async {
            let n = o.n();
            let mut all: Vec<Tensor> = vec![t.clone(); n];
            if n > 1 {
                self.all_gather_steps(&o, &mut all, 0).await?;
            }
            Ok(all)
        }
        .await;
        self.end(&o);
        out
    }
}

/// A sum over `n` members divided by `n`: for integer elements the quotient rounded toward
/// zero (NCCL's average of integers), not the sum times `1/n`, which truncates to 0 first.
pub(super) fn mean_of(sum: Tensor, n: usize) -> candle_core::Result<Tensor> {
    if sum.dtype().is_float() {
        sum / n as f64
    } else {
        let n = Tensor::new(n as f64, sum.device())?.to_dtype(sum.dtype())?;
        sum.broadcast_div(&n)
    }
}

//! Per-peer device maps, as in PyTorch's TensorPipe options.
//!
//! For each peer, a one-to-one map from this worker's devices to the peer's. A tensor this
//! worker sends to that peer in a request lands on the mapped device; tensors in the peer's
//! reply come back through the inverse map, which travels with each call (per hop: the peer's
//! own nested calls use the peer's maps). Devices without an entry keep their identity.
//!
//! - DM-1: maps are validated when installed: known peer, not this worker, one-to-one, and
//!   every local device usable here.

use rpc_core::ext::{AgentExt, MessageKind};
use rpc_core::Agent;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use crate::device::{DeviceError, DeviceSpec};

const REPLY_MAP_KEY: &str = "autograd.devmap.reply";

/// Why a device map was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceMapError {
    /// A device did not parse.
    #[error("device map for `{peer}`")]
    Device {
        /// The peer.
        peer: String,
        /// The cause.
        #[source]
        source: DeviceError,
    },
    /// The peer is not in the group.
    #[error("device map names `{0}`, which is not a worker of this group")]
    UnknownPeer(String),
    /// A map for this worker itself.
    #[error("device map names this worker (`{0}`) as its own peer")]
    SelfMap(String),
    /// Two local devices map to one peer device, or one local device to two.
    #[error("device map for `{peer}` is not one-to-one: {detail}")]
    NotOneToOne {
        /// The peer.
        peer: String,
        /// The clash.
        detail: String,
    },
}

/// Device maps for a worker's peers; build with [`DeviceMaps::map`], then [`DeviceMaps::install`].
///
/// ```
/// let maps = autograd_dist::DeviceMaps::new().map("worker1", "cpu", "cpu")?;
/// # Ok::<(), autograd_dist::DeviceMapError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct DeviceMaps {
    maps: BTreeMap<String, BTreeMap<DeviceSpec, DeviceSpec>>,
}

impl DeviceMaps {
    /// No maps.
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps local device `local` to `remote` on `peer` (devices as `cpu` or `cuda:N`).
    pub fn map(mut self, peer: &str, local: &str, remote: &str) -> Result<Self, DeviceMapError> {
        let parse = |s: &str| {
            s.parse::<DeviceSpec>()
                .map_err(|source| DeviceMapError::Device {
                    peer: peer.to_owned(),
                    source,
                })
        };
        let (l, r) = (parse(local)?, parse(remote)?);
        let m = self.maps.entry(peer.to_owned()).or_default();
        if let Some(prev) = m.get(&l) {
            if *prev != r {
                return Err(DeviceMapError::NotOneToOne {
                    peer: peer.to_owned(),
                    detail: format!("{l} maps to both {prev} and {r}"),
                });
            }
        }
        if let Some((other, _)) = m.iter().find(|(k, v)| **v == r && **k != l) {
            return Err(DeviceMapError::NotOneToOne {
                peer: peer.to_owned(),
                detail: format!("{other} and {l} both map to {r}"),
            });
        }
        m.insert(l, r);
        Ok(self)
    }

    /// Validates the maps against `agent`'s group and this machine (DM-1), and applies them to
    /// every tensor `agent` sends from now on.
    pub fn install(self, agent: &Agent) -> Result<(), DeviceMapError> {
        let mut by_rank = HashMap::new();
        for (peer, m) in self.maps {
            let info = agent
                .get_worker_info(peer.as_str())
                .map_err(|_| DeviceMapError::UnknownPeer(peer.clone()))?;
            if info.id.0 == agent.rank() {
                return Err(DeviceMapError::SelfMap(peer));
            }
            for local in m.keys() {
                local.device().map_err(|source| DeviceMapError::Device {
                    peer: peer.clone(),
                    source,
                })?;
            }
            by_rank.insert(info.id.0, m);
        }
        let state = maps_of(agent);
        *state.write().unwrap_or_else(|p| p.into_inner()) = by_rank;
        let provider_state = state.clone();
        agent.set_meta_provider(
            REPLY_MAP_KEY,
            Arc::new(move |to| {
                let m = provider_state.read().unwrap_or_else(|p| p.into_inner());
                let inverse: Vec<(DeviceSpec, DeviceSpec)> =
                    m.get(&to.0)?.iter().map(|(l, r)| (*r, *l)).collect();
                Some(encode_pairs(to.0, &inverse))
            }),
        );
        Ok(())
    }
}

type Maps = RwLock<HashMap<u32, BTreeMap<DeviceSpec, DeviceSpec>>>;

fn maps_of(agent: &Agent) -> Arc<Maps> {
    agent.extension(|| RwLock::new(HashMap::new()))
}

/// The reply map of a call, for the callee `for_rank` only (a callee's own nested calls must not
/// apply its caller's map).
fn encode_pairs(for_rank: u32, pairs: &[(DeviceSpec, DeviceSpec)]) -> Vec<u8> {
    std::iter::once(for_rank)
        .chain(pairs.iter().flat_map(|(a, b)| [code(*a), code(*b)]))
        .flat_map(u32::to_le_bytes)
        .collect()
}

fn decode_pairs(bytes: &[u8]) -> (u32, Vec<(DeviceSpec, DeviceSpec)>) {
    let codes: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let Some((&for_rank, rest)) = codes.split_first() else {
        return (u32::MAX, Vec::new());
    };
    (
        for_rank,
        rest.chunks_exact(2)
            .map(|p| (uncode(p[0]), uncode(p[1])))
            .collect(),
    )
}

fn code(d: DeviceSpec) -> u32 {
    match d {
        DeviceSpec::Cpu => 0,
        DeviceSpec::Cuda(n) => n as u32 + 1,
    }
}

fn uncode(c: u32) -> DeviceSpec {
    match c {
        0 => DeviceSpec::Cpu,
        n => DeviceSpec::Cuda(n as usize - 1),
    }
}

/// The device a tensor on `dev` should arrive on at `peer`, for a message of `kind`.
pub(crate) fn target(agent: &Agent, peer: u32, kind: MessageKind, dev: DeviceSpec) -> DeviceSpec {
    match kind {
        MessageKind::Request => {
            let m = maps_of(agent);
            let m = m.read().unwrap_or_else(|p| p.into_inner());
            m.get(&peer)
                .and_then(|m| m.get(&dev))
                .copied()
                .unwrap_or(dev)
        }
        MessageKind::Reply => rpc_core::ext::call_meta(REPLY_MAP_KEY)
            .map(|b| decode_pairs(&b))
            .filter(|(for_rank, _)| *for_rank == agent.rank())
            .and_then(|(_, pairs)| {
                pairs
                    .into_iter()
                    .find(|(from, _)| *from == dev)
                    .map(|(_, to)| to)
            })
            .unwrap_or(dev),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_must_be_one_to_one_and_parse() {
        let m = DeviceMaps::new().map("w1", "cuda:0", "cuda:1").unwrap();
        assert!(matches!(
            m.clone().map("w1", "cuda:0", "cuda:2"),
            Err(DeviceMapError::NotOneToOne { .. })
        ));
        assert!(matches!(
            m.clone().map("w1", "cuda:3", "cuda:1"),
            Err(DeviceMapError::NotOneToOne { .. })
        ));
        assert!(
            m.clone().map("w2", "cuda:3", "cuda:1").is_ok(),
            "maps are per peer"
        );
        assert!(matches!(
            m.map("w1", "gpu0", "cpu"),
            Err(DeviceMapError::Device { .. })
        ));
    }

    #[test]
    fn reply_maps_round_trip_through_bytes() {
        let pairs = vec![
            (DeviceSpec::Cuda(1), DeviceSpec::Cuda(0)),
            (DeviceSpec::Cpu, DeviceSpec::Cuda(7)),
        ];
        assert_eq!(decode_pairs(&encode_pairs(3, &pairs)), (3, pairs));
    }
}

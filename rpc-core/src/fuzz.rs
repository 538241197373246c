//! Entry points for coverage-guided fuzzing of everything a worker decodes from a peer, for
//! the targets of the `fuzz/` crate (built with the `fuzzing` feature; `cargo test` replays
//! generated seeds and mutations of them through the same functions). Not an API: each takes
//! arbitrary bytes and panics only on a finding.

pub use crate::net::fuzz::{
    bulk_records, handshake_client, handshake_server, reply_frames, request_frames, sealed_records,
};

/// Rendezvous messages, as the rendezvous and a joining worker read them.
pub fn rendezvous(data: &[u8]) {
    crate::rendezvous::fuzz_messages(data);
}

/// A fuzz target: its name, its entry point and well-formed inputs to start from.
pub type Target = (&'static str, fn(&[u8]), Vec<Vec<u8>>);

/// Every target of this crate.
pub fn targets() -> Vec<Target> {
    let mut seeds: std::collections::HashMap<_, _> =
        crate::net::fuzz::seeds().into_iter().collect();
    let mut take = |name: &str| seeds.remove(name).unwrap_or_default();
    vec![
        ("request", request_frames as fn(&[u8]), take("request")),
        ("reply", reply_frames, take("reply")),
        ("bulk", bulk_records, take("bulk")),
        (
            "handshake_server",
            handshake_server,
            take("handshake_server"),
        ),
        (
            "handshake_client",
            handshake_client,
            take("handshake_client"),
        ),
        ("sealed", sealed_records, take("sealed")),
        ("rendezvous", rendezvous, crate::rendezvous::fuzz_seeds()),
    ]
}

#[cfg(test)]
mod tests {
    #[test]
    fn seeds_and_their_mutations_decode_without_a_finding() {
        for (name, target, seeds) in super::targets() {
            assert!(!seeds.is_empty(), "{name} has no seeds");
            let runs = crate::testing::replay_fuzz_target(name, &seeds, 2_000, target);
            assert!(runs >= seeds.len(), "{name}: {runs} runs");
        }
    }
}

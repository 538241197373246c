//! Rendezvous messages as both ends read them, for the fuzz targets and their seeds.

use serde::Serialize;
use tokio_util::codec::LengthDelimitedCodec;

use super::{check_table, refusal, GroupSize, Join, Member, Verdict, View, MAX_MSG};
use crate::net::{Endpoint, Standing};

/// Rendezvous messages as both ends read them (for fuzzing): length-delimited frames, the
/// first decoded as a join the server judges against three that joined before, the rest as
/// verdicts the joining worker checks.
pub(crate) fn fuzz_messages(data: &[u8]) {
    use tokio_util::codec::Decoder;
    let mut codec = LengthDelimitedCodec::builder()
        .max_frame_length(MAX_MSG)
        .new_codec();
    let mut buf = bytes::BytesMut::from(data);
    let me = Join {
        name: "w1".into(),
        rank: 1,
        size: GroupSize::fixed(3),
        addr: "127.0.0.1:1".into(),
        heartbeat: String::new(),
        replace: false,
        token: None,
        resume: None,
    };
    let before = [
        me.clone(),
        Join {
            name: "w2".into(),
            rank: 2,
            ..me.clone()
        },
    ];
    let mut first = true;
    while let Ok(Some(frame)) = codec.decode(&mut buf) {
        if std::mem::take(&mut first) {
            if let Ok(join) = bincode::deserialize::<Join>(&frame) {
                let why = refusal(&join, GroupSize::fixed(3), before.iter());
                let fits = join.size == GroupSize::fixed(3) && join.rank < 3;
                let clash = before
                    .iter()
                    .any(|j| j.rank == join.rank || j.name == join.name);
                assert_eq!(why.is_none(), fits && !clash, "{join:?}: {why:?}");
            }
        } else if let Ok(Verdict::Table(t, _)) = bincode::deserialize::<Verdict>(&frame) {
            if let Ok(t) = check_table(t, &me) {
                assert_eq!(t.members.len(), 3);
                assert_eq!(t.members[1].endpoint.name, "w1");
            }
        }
    }
}

/// Well-formed rendezvous messages for [`fuzz_messages`]: a join, then a verdict.
pub(crate) fn fuzz_seeds() -> Vec<Vec<u8>> {
    let framed = |parts: &[Vec<u8>]| {
        let mut out = Vec::new();
        for p in parts {
            out.extend_from_slice(&(p.len() as u32).to_be_bytes());
            out.extend_from_slice(p);
        }
        out
    };
    let join = Join {
        name: "w0".into(),
        rank: 0,
        size: GroupSize::fixed(3),
        addr: "127.0.0.1:5000".into(),
        heartbeat: "127.0.0.1:5001".into(),
        replace: false,
        token: None,
        resume: None,
    };
    let table = Verdict::Table(
        View {
            job: String::new(),
            named: None,
            sink: None,
            generation: 0,
            members: ["w0", "w1", "w2"]
                .iter()
                .map(|n| Member {
                    endpoint: Endpoint {
                        name: (*n).into(),
                        addr: "127.0.0.1:1".into(),
                        heartbeat: String::new(),
                        incarnation: 0,
                    },
                    standing: Standing::Alive,
                })
                .collect(),
        },
        "a1b2".into(),
    );
    fn enc<T: Serialize>(v: &T) -> Vec<u8> {
        bincode::serialize(v).expect("encodes")
    }
    vec![
        framed(&[enc(&join), enc(&table)]),
        framed(&[
            enc(&join),
            enc(&Verdict::Missing(vec![1, 2])),
            enc(&Verdict::Refused("no".into())),
            enc(&Verdict::Held("held".into())),
            enc(&Verdict::Ended),
        ]),
    ]
}

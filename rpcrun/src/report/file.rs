//! A trace file's events, typed and borrowed from the file's bytes: the fields the report, the
//! check and the drawing read, about 250 bytes an event where a `serde_json::Value` took about
//! 3 KB (four full parts, 2.1 M events, were 6 GB as values).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

/// A trace in the Trace Event Format (a merged one, or a single part).
#[derive(Debug, Deserialize)]
pub struct TraceFile<'a> {
    /// Its events, in file order.
    #[serde(rename = "traceEvents", borrow)]
    pub events: Vec<Event<'a>>,
    /// Its `otherData` (`rpc_trace` holds what the framework records about the parts).
    #[serde(rename = "otherData", default)]
    pub other: Value,
}

/// One event: the fields of the phases this framework writes, each absent when the event has
/// none (`ph` `X` a complete span, `M` metadata, `i` an instant, `s` / `f` a flow's ends).
#[derive(Debug, Default, Deserialize)]
pub struct Event<'a> {
    /// The phase.
    #[serde(borrow, default)]
    pub ph: Cow<'a, str>,
    /// The name.
    #[serde(borrow, default)]
    pub name: Cow<'a, str>,
    /// The category.
    #[serde(borrow, default)]
    pub cat: Cow<'a, str>,
    /// The process: the rank.
    pub pid: Option<u64>,
    /// The track.
    pub tid: Option<u64>,
    /// The start, microseconds.
    pub ts: Option<f64>,
    /// The length, microseconds (`X`).
    pub dur: Option<f64>,
    /// A flow's id (`s`, `f`).
    pub id: Option<u64>,
    /// What a flow's end binds to (`f`: `e`, the enclosing slice).
    pub bp: Option<String>,
    /// An instant's scope (`i`).
    pub s: Option<String>,
    /// The arguments this framework reads.
    #[serde(borrow)]
    pub args: Option<Args<'a>>,
}

/// The arguments of an event that the report reads.
#[derive(Debug, Default, Deserialize)]
pub struct Args<'a> {
    /// A call's flow id (on a call made and the call served).
    pub flow: Option<u64>,
    /// A metadata event's name (a process's or a track's).
    pub name: Option<String>,
    /// What the span's recorder said of it (`step 12` on a step span).
    #[serde(borrow)]
    pub detail: Option<Cow<'a, str>>,
}

impl<'a> TraceFile<'a> {
    /// Parses a trace file's bytes; its events borrow from them.
    pub fn from_slice(bytes: &'a [u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a trace: {e}"))
    }

    /// Reads a trace already parsed as a value; its events borrow from it.
    pub fn from_value(v: &'a Value) -> Result<Self, String> {
        Self::deserialize(v).map_err(|e| format!("not a trace: {e}"))
    }

    /// `otherData.rpc_trace`'s value at `pointer` (`/missing_ranks`, say).
    pub fn rpc_trace(&self, pointer: &str) -> Option<&Value> {
        self.other.pointer(&format!("/rpc_trace{pointer}"))
    }
}

impl Event<'_> {
    /// Its flow id, on a call made or served.
    pub fn flow(&self) -> Option<u64> {
        self.args.as_ref()?.flow
    }

    /// Its `args.name` (a metadata event's), if any.
    pub fn arg_name(&self) -> Option<&str> {
        self.args.as_ref()?.name.as_deref()
    }

    /// Its `args.detail`, if any.
    pub fn detail(&self) -> Option<&str> {
        self.args.as_ref()?.detail.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes and a parsed value read alike; other fields and other arguments are ignored, an
    /// escaped name is read whole.
    #[test]
    fn bytes_and_values_read_alike() {
        let text = br#"{"traceEvents":[
            {"ph":"X","name":"a\"b","cat":"call","pid":1,"tid":2,"ts":3.5,"dur":1,
             "args":{"flow":7,"bytes":10,"outcome":"ok"}},
            {"ph":"M","name":"process_name","pid":1,"args":{"name":"w1","sort_index":1}}],
            "displayTimeUnit":"ms","otherData":{"rpc_trace":{"missing_ranks":[2]}}}"#;
        let v: Value = serde_json::from_slice(text).unwrap();
        for f in [
            TraceFile::from_slice(text).unwrap(),
            TraceFile::from_value(&v).unwrap(),
        ] {
            let [x, m] = &f.events[..] else {
                panic!("{f:?}")
            };
            assert_eq!((&*x.ph, &*x.name, &*x.cat), ("X", "a\"b", "call"));
            assert_eq!(
                (x.pid, x.tid, x.ts, x.dur),
                (Some(1), Some(2), Some(3.5), Some(1.0))
            );
            assert_eq!((x.flow(), m.arg_name()), (Some(7), Some("w1")));
            assert_eq!(f.rpc_trace("/missing_ranks"), Some(&serde_json::json!([2])));
        }
        let err = TraceFile::from_slice(b"{\"traceEvents\": 3}").unwrap_err();
        assert!(err.starts_with("not a trace"), "{err}");
    }
}

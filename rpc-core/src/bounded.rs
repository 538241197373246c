//! Decoding lists of bounded length. A list whose items are a byte or two on the wire but tens
//! in memory (metadata entries, blob table entries, error chains) would otherwise let one
//! frame of an authenticated but hostile or broken peer ask for gigabytes (FRAME-3).

use serde::de::{Deserialize, Deserializer, SeqAccess, Visitor};
use std::fmt;
use std::marker::PhantomData;

/// Most entries an envelope's blob table may have.
pub(crate) const MAX_BLOBS: usize = 1 << 16;
/// Most keys a call's metadata may have.
pub(crate) const MAX_META: usize = 256;

/// Decodes a list of at most `MAX` items, refusing a longer one before allocating for it
/// (FRAME-3: a list whose items are a byte or two on the wire but tens in memory, such as
/// metadata entries, would otherwise let one frame ask for gigabytes).
pub(crate) fn bounded<'de, D, T, const MAX: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T, const MAX: usize>(PhantomData<T>);
    impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for Bounded<T, MAX> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a list of at most {MAX} items")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let announced = seq.size_hint().unwrap_or(0);
            if announced > MAX {
                return Err(serde::de::Error::custom(format!(
                    "a list of {announced} items, above the limit of {MAX}"
                )));
            }
            let mut v = Vec::with_capacity(announced);
            while let Some(x) = seq.next_element()? {
                if v.len() == MAX {
                    return Err(serde::de::Error::custom(format!(
                        "a list of more than {MAX} items"
                    )));
                }
                v.push(x);
            }
            Ok(v)
        }
    }
    d.deserialize_seq(Bounded::<T, MAX>(PhantomData))
}

//! The task both training examples learn: which of eight languages a word is written in, from
//! its characters (Debian word lists, `data/wordlang`).
//!
//! - `wordlang`: the data set's files and languages.
//! - `data`: words to tensors (the vocabulary, batches, the epoch order, dropout masks), every
//!   random choice a function of the seed and the step.
//! - `model`: the character embedding, the LSTM encoder and the classifier head's layers.
//! - `lstm`: the LSTM recurrence as one operation with a hand-written backward.

pub mod data;
pub mod lstm;
pub mod model;
pub mod wordlang;

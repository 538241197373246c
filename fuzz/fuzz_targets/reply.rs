#![no_main]

libfuzzer_sys::fuzz_target!(
    init: rpc_fuzz::seed_corpus("reply"),
    |data: &[u8]| rpc_core::fuzz::reply_frames(data)
);

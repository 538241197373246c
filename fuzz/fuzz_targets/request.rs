#![no_main]

libfuzzer_sys::fuzz_target!(
    init: rpc_fuzz::seed_corpus("request"),
    |data: &[u8]| rpc_core::fuzz::request_frames(data)
);

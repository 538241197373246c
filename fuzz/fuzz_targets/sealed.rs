#![no_main]

libfuzzer_sys::fuzz_target!(
    init: rpc_fuzz::seed_corpus("sealed"),
    |data: &[u8]| rpc_core::fuzz::sealed_records(data)
);

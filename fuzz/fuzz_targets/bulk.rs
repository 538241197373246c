#![no_main]

libfuzzer_sys::fuzz_target!(
    init: rpc_fuzz::seed_corpus("bulk"),
    |data: &[u8]| rpc_core::fuzz::bulk_records(data)
);

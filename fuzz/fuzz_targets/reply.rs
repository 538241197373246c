#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rpc_core::fuzz::reply_frames(data));

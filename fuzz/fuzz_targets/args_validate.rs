//! Compiling any JSON value as a schema and validating any JSON value against it must never panic.
//! The input is split in two halves: the schema (JSON) and the instance (JSON).
#![no_main]

use libfuzzer_sys::fuzz_target;
use toolsrv_meta::ArgsValidator;

fuzz_target!(|data: &[u8]| {
    let (schema, instance) = data.split_at(data.len() / 2);
    let (Ok(schema), Ok(instance)) = (
        serde_json::from_slice::<serde_json::Value>(schema),
        serde_json::from_slice::<serde_json::Value>(instance),
    ) else {
        return;
    };
    if let Ok(validator) = ArgsValidator::compile(&schema) {
        if let Err(e) = validator.validate(&instance) {
            let _ = e.to_string();
        }
    }
});

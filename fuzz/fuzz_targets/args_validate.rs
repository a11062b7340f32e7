//! Compiling any JSON value as a schema and validating any JSON value against it must never panic.
//! The input is split in two halves: the schema (JSON) and the instance (JSON).
//!
//! The whole input is also read as call arguments without building anything
//! (`read_json_values`, under `check_args_json`): without a limit the reading must agree with
//! serde_json's own parse (refused when it fails, an object when it gives one), and with a
//! small limit, text it takes must parse into no more values than the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use toolsrv_meta::{ArgsValidator, JsonValuesError, read_json_values};

/// Every value in `v`, `v` included.
fn values(v: &Value) -> usize {
    1 + match v {
        Value::Array(items) => items.iter().map(values).sum(),
        Value::Object(map) => map.values().map(values).sum(),
        _ => 0,
    }
}

fuzz_target!(|data: &[u8]| {
    let parsed = serde_json::from_slice::<Value>(data);
    // Without a limit the reading agrees with serde_json's parse.
    match (read_json_values(data, usize::MAX), &parsed) {
        (Err(JsonValuesError::Invalid(_)), Err(_)) => {}
        (Ok(object), Ok(v)) => assert_eq!(object, v.is_object()),
        (read, parsed) => panic!("read {read:?}, parsed {parsed:?}"),
    }
    // With a small one, text it takes holds no more values than the limit (a parsed tree holds
    // at most what the text does: a repeated key keeps one value).
    if let (Ok(_), Ok(v)) = (read_json_values(data, 16), &parsed) {
        assert!(values(v) <= 16, "{}", values(v));
    }

    let (schema, instance) = data.split_at(data.len() / 2);
    let (Ok(schema), Ok(instance)) = (
        serde_json::from_slice::<Value>(schema),
        serde_json::from_slice::<Value>(instance),
    ) else {
        return;
    };
    if let Ok(validator) = ArgsValidator::compile(&schema) {
        if let Err(e) = validator.validate(&instance) {
            let _ = e.to_string();
        }
    }
});

//! The encoders against a reference, and the model directories they refuse.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, safetensors};
use toolsrv_find::{Encoder, FindError, VECTORS_REVISION};

const REQUEST: &str = "how hot is this machine running";

/// Each encoder's first 8 dimensions for [`REQUEST`], computed in f32 by a separate NumPy
/// transcription of the reference forward pass (mean pooling, unit length). The 8-bit dense
/// layers move a dimension by 0.003 at most (MiniLM; MPNet 0.002).
fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn both_encoders_agree_with_the_reference() {
    let cases = [
        (
            toolsrv_testkit::find_model_dir(),
            [
                0.02885, -0.00726, -0.04669, 0.05916, -0.00987, -0.05378, -0.05122, -0.05944,
            ],
        ),
        (
            toolsrv_testkit::mpnet_model_dir(),
            [
                -0.05388, -0.08721, 0.01525, 0.04164, -0.03316, -0.00166, -0.03944, 0.03081,
            ],
        ),
    ];
    for (dir, reference) in cases {
        let encoder = Encoder::load(&dir).unwrap();
        let ours = &encoder.embed(&[REQUEST]).unwrap()[0];
        for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
            assert!(
                (a - b).abs() < 0.005,
                "{}: dimension {i} is {a}, the reference {b}",
                dir.display()
            );
        }
        // Padded next to a longer text, a request comes out the same as alone.
        let batch = encoder
            .embed(&[
                REQUEST,
                "restart the web frontend and tell me whether it came back up in time",
            ])
            .unwrap();
        assert!(cosine(ours, &batch[0]) > 0.9999, "{}", dir.display());
    }
}

/// Kept vectors ([`toolsrv_find::VectorStore`]) are filed under the encoder's fingerprint,
/// which covers the model's files and [`VECTORS_REVISION`] but not this code: a change to the
/// arithmetic that moves the vectors must raise the revision, or files kept before it would be
/// mixed with new vectors. So the vectors of this revision are pinned here, to 1e-4: well under
/// what a change of the arithmetic moves (8-bit weights moved dimensions by up to 3e-3), well
/// over what rounding differs by between CPUs. When this fails after a deliberate change, raise
/// `VECTORS_REVISION` and pin the new values.
#[test]
fn the_vectors_of_this_revision_have_not_moved() {
    assert_eq!(
        VECTORS_REVISION, 1,
        "pin the vectors of the new revision below"
    );
    let cases = [
        (toolsrv_testkit::find_model_dir(), PINNED_MINILM),
        (toolsrv_testkit::mpnet_model_dir(), PINNED_MPNET),
    ];
    for (dir, pinned) in cases {
        let ours = &Encoder::load(&dir).unwrap().embed(&[REQUEST]).unwrap()[0];
        let moved: Vec<(usize, f32, f32)> = ours
            .iter()
            .zip(pinned)
            .enumerate()
            .filter(|(_, (a, b))| (*a - b).abs() > 1e-4)
            .map(|(i, (a, b))| (i, *a, b))
            .collect();
        assert!(
            moved.is_empty(),
            "{}: (dimension, now, pinned) {moved:?}; now {:?}",
            dir.display(),
            &ours[..8]
        );
    }
}

const PINNED_MINILM: [f32; 8] = [
    0.029899566,
    -0.007292024,
    -0.043438055,
    0.058415193,
    -0.008504474,
    -0.05070143,
    -0.05179326,
    -0.06031373,
];
const PINNED_MPNET: [f32; 8] = [
    -0.05384336,
    -0.08725662,
    0.014535444,
    0.042211972,
    -0.032609306,
    -0.0010268139,
    -0.03777484,
    0.031203235,
];

/// A copy of the small model's directory, with `config.json` as given.
fn model_with_config(config: &str) -> tempfile::TempDir {
    let real = toolsrv_testkit::find_model_dir();
    let dir = tempfile::tempdir().unwrap();
    for file in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(real.join(file), dir.path().join(file)).unwrap();
    }
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    dir
}

fn refusal(dir: &Path) -> String {
    match Encoder::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e @ FindError::ModelFile { .. }) => e.to_string(),
        Err(e) => panic!("{}: {e:?}", dir.display()),
    }
}

#[test]
fn configurations_the_encoder_cannot_run_are_refused_naming_what() {
    let real =
        std::fs::read_to_string(toolsrv_testkit::find_model_dir().join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&real).unwrap();
    let cases = [
        (
            "position_embedding_type",
            serde_json::json!("relative_key"),
            "relative_key",
        ),
        ("hidden_act", serde_json::json!("swish"), "swish"),
        (
            "num_attention_heads",
            serde_json::json!(5),
            "num_attention_heads 5",
        ),
        (
            "num_attention_heads",
            serde_json::json!(0),
            "num_attention_heads 0",
        ),
        (
            "max_position_embeddings",
            serde_json::json!(1),
            "max_position_embeddings",
        ),
        ("hidden_size", serde_json::json!(-3), "hidden_size"),
    ];
    for (field, value, says) in cases {
        let saved = config[field].clone();
        config[field] = value;
        let dir = model_with_config(&config.to_string());
        let err = refusal(dir.path());
        assert!(
            err.contains(&dir.path().display().to_string()) && err.contains(says),
            "{field}: {err}"
        );
        config[field] = saved;
    }
}

/// A tokenizer of another model, with ids past the model's vocabulary: refused when loaded.
#[test]
fn a_tokenizer_of_another_model_is_refused_when_loaded() {
    let real = toolsrv_testkit::find_model_dir();
    let dir = model_with_config(&std::fs::read_to_string(real.join("config.json")).unwrap());
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(real.join("tokenizer.json")).unwrap())
            .unwrap();
    tokenizer["model"]["vocab"]["disk"] = serde_json::json!(40000);
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let err = refusal(dir.path());
    assert!(
        err.contains("tokenizer.json") && err.contains("40000") && err.contains("30522"),
        "{err}"
    );
}

/// Some BERT checkpoints name their weights `bert.embeddings...`: they load and encode the same.
#[test]
fn bert_weights_load_with_or_without_their_prefix() {
    let real = toolsrv_testkit::find_model_dir();
    let tensors = safetensors::load(real.join("model.safetensors"), &Device::Cpu).unwrap();
    let prefixed: HashMap<String, _> = tensors
        .into_iter()
        .map(|(name, t)| (format!("bert.{name}"), t))
        .collect();
    let dir = model_with_config(&std::fs::read_to_string(real.join("config.json")).unwrap());
    safetensors::save(&prefixed, dir.path().join("model.safetensors")).unwrap();
    let plain = Encoder::load(&real).unwrap().embed(&[REQUEST]).unwrap();
    let renamed = Encoder::load(dir.path())
        .unwrap()
        .embed(&[REQUEST])
        .unwrap();
    assert_eq!(plain, renamed);
}

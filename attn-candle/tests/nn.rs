//! The candle-nn layer loads the multihead golden cases' weights (PyTorch names, written
//! to a weights-only safetensors file) through a `VarBuilder` and reproduces each case's
//! `out` within the file's tolerance (the qk-LN files with `q_ln.*` and `k_ln.*` too).

use std::collections::HashMap;

use attn_candle::AttnOptions;
use attn_candle::nn::{LayerCall, MultiheadDilatedAttention};
use attn_multihead::Bias;
use attn_multihead::metadata::config_from_metadata;
use attn_testkit::golden::{golden_dir, load_dir};
use attn_testkit::tolerance::rel_l2_error;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

#[test]
fn multihead_golden_cases_load_and_reproduce_their_output() {
    let mut checked = 0;
    for dir in ["multihead", "multihead_features", "multihead_qkln"] {
        let path = golden_dir().join(dir);
        for (file, case) in load_dir(&path).expect("golden directory") {
            let case = case.expect("case loads");
            let all = candle_core::safetensors::load(&file, &Device::Cpu).expect("safetensors");
            let weights: HashMap<String, Tensor> = all
                .iter()
                .filter(|(k, _)| k.ends_with(".weight") || k.ends_with(".bias"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let saved =
                std::env::temp_dir().join(format!("attn-candle-{}-{}.safetensors", case.name, std::process::id()));
            candle_core::safetensors::save(&weights, &saved).expect("save weights");
            let loaded = candle_core::safetensors::load(&saved, &Device::Cpu).expect("load weights");
            std::fs::remove_file(&saved).expect("remove");
            let vb = VarBuilder::from_tensors(loaded, DType::F32, &Device::Cpu);
            let bias = if weights.contains_key("q_proj.bias") { Bias::Zeros } else { Bias::Absent };
            let config = config_from_metadata(&case.meta, bias).expect("config");
            let layer = MultiheadDilatedAttention::new(config.clone(), vb).expect("layer loads");
            let mut masks = AttnOptions::new(config.attention.clone());
            if let Some(mask) = case.masks.key_padding() {
                masks = masks.with_key_padding(mask.clone());
            }
            let query = &all["query"];
            let out = if case.bool_meta("cross_attention").unwrap_or(false) {
                layer.forward_with(query, &LayerCall::new().masks(&masks).cross(&all["key"], &all["value"]))
            } else {
                layer.forward_with(query, &LayerCall::new().masks(&masks))
            }
            .expect("forward");
            let got: Vec<f32> = out.flatten_all().and_then(|t| t.to_vec1()).expect("values");
            let err = rel_l2_error(&got, &case.tensor("out").expect("out").data);
            let tol = case.rel_tol().expect("rel_tol");
            assert!(err <= tol, "{}: out off by {err:.2e} (bound {tol:.0e})", case.name);
            // The bound bites: the output 1e-3 off fails it.
            let bad: Vec<f32> = got.iter().map(|x| x * 1.001).collect();
            assert!(rel_l2_error(&bad, &case.tensor("out").expect("out").data) > tol);
            checked += 1;
        }
    }
    assert_eq!(checked, 5, "the multihead golden cases");
}

//! Safetensors weights: PyTorch names, round trips, and named errors for missing, extra or misshapen tensors.

use std::collections::HashMap;
use std::sync::Arc;

use attn_core::{AttnError, DilatedConfig};
use attn_multihead::Bias;
use attn_multihead::{
    EncoderConfig, LongNetEncoder, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams,
    ReferenceBackend, load_bytes, save_bytes,
};
use safetensors::{Dtype, SafeTensors};

fn cfg() -> MultiheadConfig {
    MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap())
}

/// A safetensors file from (name, shape, f32 values).
fn file(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn pytorch_state_dict(w: &MultiheadWeights<f32>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    w.params().into_iter().map(|p| (p.name, p.shape, p.data.to_vec())).collect()
}

#[test]
fn names_and_shapes_are_pytorchs() {
    let w = MultiheadWeights::<f32>::magneto(&cfg(), 1);
    let got: Vec<(String, Vec<usize>)> = w.params().into_iter().map(|p| (p.name, p.shape)).collect();
    let want: Vec<(String, Vec<usize>)> = [
        ("q_proj.weight", vec![8, 8]),
        ("q_proj.bias", vec![8]),
        ("k_proj.weight", vec![8, 8]),
        ("k_proj.bias", vec![8]),
        ("v_proj.weight", vec![8, 8]),
        ("v_proj.bias", vec![8]),
        ("norm.weight", vec![8]),
        ("norm.bias", vec![8]),
        ("out_proj.weight", vec![8, 8]),
        ("out_proj.bias", vec![8]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect();
    assert_eq!(got, want);
    // Fused storage: q_proj.weight is rows 0..E of in_proj, v_proj.bias the last E biases.
    assert_eq!(w.params()[0].data, &w.in_proj.weight[..64]);
    assert_eq!(w.params()[4].data, &w.in_proj.weight[128..]);
}

#[test]
fn a_pytorch_state_dict_loads_unchanged_and_round_trips() {
    let src = MultiheadWeights::<f32>::magneto(&cfg(), 1);
    let mut sd = pytorch_state_dict(&src);
    for (i, (_, _, v)) in sd.iter_mut().enumerate() {
        v.iter_mut().enumerate().for_each(|(j, x)| *x = (i * 100 + j) as f32 * 0.01);
    }
    let bytes = file(&sd);
    let mut w = MultiheadWeights::<f32>::magneto(&cfg(), 2);
    load_bytes(&mut w, &bytes).unwrap();
    assert_eq!(pytorch_state_dict(&w), sd);
    let saved = save_bytes(&w, Some(HashMap::from([("format".to_string(), "pt".to_string())]))).unwrap();
    let mut again = MultiheadWeights::<f32>::magneto(&cfg(), 3);
    load_bytes(&mut again, &saved).unwrap();
    assert_eq!(again, w);
    // f64 layers load f32 files, and save F64.
    let mut w64 = MultiheadWeights::<f64>::magneto(&cfg(), 4);
    load_bytes(&mut w64, &bytes).unwrap();
    assert_eq!(w64.out_proj.weight[3], sd[8].2[3] as f64);
    let st_bytes = save_bytes(&w64, None).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    assert_eq!(st.tensor("k_proj.weight").unwrap().dtype(), Dtype::F64);
}

#[test]
fn missing_extra_and_misshapen_tensors_are_named() {
    let w = MultiheadWeights::<f32>::magneto(&cfg(), 1);
    let sd = pytorch_state_dict(&w);
    let err = |sd: &[(String, Vec<usize>, Vec<f32>)]| {
        let mut target = MultiheadWeights::<f32>::magneto(&cfg(), 9);
        let before = target.clone();
        let e = load_bytes(&mut target, &file(sd)).unwrap_err();
        assert_eq!(target, before, "a failed load leaves the weights unchanged");
        assert!(matches!(e, AttnError::Format(_)));
        e.to_string()
    };
    let missing: Vec<_> = sd.iter().filter(|(n, _, _)| n != "k_proj.bias").cloned().collect();
    let msg = err(&missing);
    assert!(msg.contains("missing") && msg.contains("`k_proj.bias`"), "{msg}");
    let mut extra = sd.clone();
    extra.push(("in_proj_weight".into(), vec![2], vec![0.0, 1.0]));
    let msg = err(&extra);
    assert!(msg.contains("unexpected") && msg.contains("`in_proj_weight`"), "{msg}");
    let mut bad = sd.clone();
    bad[8] = ("out_proj.weight".into(), vec![4, 16], vec![0.0; 64]);
    let msg = err(&bad);
    assert!(msg.contains("`out_proj.weight`") && msg.contains("[4, 16]") && msg.contains("[8, 8]"), "{msg}");
    let msg = load_bytes(&mut MultiheadWeights::<f32>::magneto(&cfg(), 1), b"not a file").unwrap_err().to_string();
    assert!(msg.contains("safetensors"), "{msg}");
}

#[test]
fn weights_of_another_layout_are_rejected_by_the_layer() {
    let w = MultiheadWeights::<f64>::magneto(&cfg().with_bias(Bias::Absent), 1);
    let e = MultiheadDilatedAttention::from_weights(cfg(), w, Arc::new(ReferenceBackend)).unwrap_err();
    assert!(e.to_string().contains("do not match"), "{e}");
}

#[test]
fn encoder_checkpoints_round_trip_with_layer_prefixes() {
    let enc = LongNetEncoder::<f32>::new(
        EncoderConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap(), 16),
        2,
        5,
        Arc::new(ReferenceBackend),
    )
    .unwrap();
    let bytes = save_bytes(&enc, None).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("layers.1.self_attn.v_proj.weight").unwrap().shape(), &[8, 8]);
    assert_eq!(st.tensor("layers.0.linear1.weight").unwrap().shape(), &[16, 8]);
    let mut other = LongNetEncoder::<f32>::new(
        EncoderConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap(), 16),
        2,
        6,
        Arc::new(ReferenceBackend),
    )
    .unwrap();
    load_bytes(&mut other, &bytes).unwrap();
    let a: Vec<Vec<f32>> = enc.params().iter().map(|p| p.data.to_vec()).collect();
    let b: Vec<Vec<f32>> = other.params().iter().map(|p| p.data.to_vec()).collect();
    assert_eq!(a, b);
}

/// `MultiheadWeights` fields are public: a zero `embed_dim` (e.g. `magneto` of an
/// unvalidated config) or a q/k/v bias shorter than `3 * embed_dim` panicked in
/// `params()` (chunks of zero, slice out of range); saving such weights is now a
/// typed error and listing them does not panic.
#[test]
fn params_of_hand_built_weights_do_not_panic() {
    let zero =
        MultiheadWeights::<f32>::magneto(&MultiheadConfig::new(0, 1, DilatedConfig::new(&[4], &[1]).unwrap()), 0);
    assert_eq!(zero.params().len(), zero.clone().params_mut().len());
    let mut short = MultiheadWeights::<f32>::magneto(&cfg(), 0);
    short.in_proj.bias = Some(vec![0.0; 12]); // q's 8, then only 4 of k's
    let listed: Vec<String> = short.params().into_iter().map(|p| p.name).collect();
    assert_eq!(listed, short.clone().params_mut().into_iter().map(|p| p.name).collect::<Vec<_>>());
    assert!(listed.iter().any(|n| n == "k_proj.bias") && !listed.iter().any(|n| n == "v_proj.bias"));
    assert!(matches!(save_bytes(&short, None), Err(AttnError::Format(_))), "k_proj.bias: 4 values for shape [8]");
}

/// `F32Tensors` is caller-built: a shape no buffer can hold made `read_tensor`
/// panic with a capacity overflow before the data length was ever compared.
#[test]
fn read_tensor_refuses_a_shape_too_large_to_allocate() {
    use attn_multihead::{F32Tensors, TensorSource};
    let shape = [1usize << 62];
    let mut t = F32Tensors::default();
    t.tensors.insert("x".into(), (&shape[..], &[][..]));
    assert!(matches!(t.read_tensor::<f32>("x"), Err(AttnError::Format(m)) if m.contains("too large")));
}

//! Backend selection: maps `--backend` (and ring options) to implementations.

use attn_testkit::{DilatedBackend, MultiheadBackend, ReferenceBackend};

use crate::options::Options;

/// The backends for one run: one per case kind (either may be absent).
pub struct Selected {
    pub label: String,
    pub dilated: Option<Box<dyn DilatedBackend>>,
    pub multihead: Option<Box<dyn MultiheadBackend>>,
}

pub fn select(o: &Options) -> Result<Selected, String> {
    if o.world_size.is_some() && o.backend != "ring" {
        return Err("--world-size needs --backend ring".into());
    }
    match o.backend.as_str() {
        "reference" => {
            if o.dtype != "f32" {
                return Err("the reference backend runs f32 files in float64; --dtype does not apply".into());
            }
            Ok(Selected { label: "reference".into(), dilated: Some(Box::new(ReferenceBackend)), multihead: None })
        }
        other => Err(format!("unknown or not yet available backend `{other}`")),
    }
}

//! The typed fields of a case and their names: `Implementation`, and the words by which
//! the library's `Mixing`, `DType`, `Strategy` and `Layout` appear on the command line,
//! in labels and in `results.json` (the names those types print, so the file keeps its
//! form and an earlier `--baseline` still matches).

use attn_core::{AttnError, DType, Mixing, Result};
use attn_ring::{Layout, Strategy};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A value with a stable name.
pub trait Named: Sized + Copy {
    fn name(self) -> &'static str;
    /// The value of `s`; a typed error naming `s` otherwise.
    fn from_name(s: &str) -> Result<Self>;
}

/// `Named` through the type's own `as_str` and `parse`.
macro_rules! named_by_parse {
    ($($t:ty),*) => {$(
        impl Named for $t {
            fn name(self) -> &'static str {
                self.as_str()
            }
            fn from_name(s: &str) -> Result<Self> {
                <$t>::parse(s)
            }
        }
    )*};
}

named_by_parse!(Mixing, Strategy, Layout);

impl Named for DType {
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn from_name(s: &str) -> Result<Self> {
        DType::parse(s).ok_or_else(|| AttnError::InvalidArgument(format!("unknown dtype `{s}` (f32|bf16|f16|f64)")))
    }
}

/// Which implementation a case runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Implementation {
    /// The float64 reference of `attn-core`.
    Reference,
    /// `CpuBackend`.
    Cpu,
    /// `CpuBackend` with a workspace kept between calls.
    CpuWorkspace,
    /// The CUDA kernels (`cuda` feature).
    Cuda,
    /// The PyTorch peer script.
    Torch,
    /// In-process ring ranks with this strategy (`ring-<strategy>`).
    Ring(Strategy),
}

impl Implementation {
    /// The name in labels, tables and `results.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            Implementation::Reference => "reference",
            Implementation::Cpu => "cpu",
            Implementation::CpuWorkspace => "cpu-workspace",
            Implementation::Cuda => "cuda",
            Implementation::Torch => "torch",
            Implementation::Ring(Strategy::Auto) => "ring-auto",
            Implementation::Ring(Strategy::Ring) => "ring-ring",
            Implementation::Ring(Strategy::AllGather) => "ring-allgather",
            Implementation::Ring(Strategy::Ulysses) => "ring-ulysses",
            // The bench's hybrid degrees by name (a name must be static for `results.json`).
            Implementation::Ring(Strategy::Hybrid { ulysses }) => match ulysses {
                2 => "ring-hybrid:2",
                4 => "ring-hybrid:4",
                8 => "ring-hybrid:8",
                _ => "ring-hybrid",
            },
        }
    }

    /// Parse a name of [`Implementation::as_str`] (`ring` alone is `ring-auto`).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "reference" => Implementation::Reference,
            "cpu" => Implementation::Cpu,
            "cpu-workspace" => Implementation::CpuWorkspace,
            "cuda" => Implementation::Cuda,
            "torch" => Implementation::Torch,
            "ring" => Implementation::Ring(Strategy::Auto),
            other => match other.strip_prefix("ring-") {
                Some(strategy) => Implementation::Ring(Strategy::parse(strategy)?),
                None => {
                    return Err(AttnError::InvalidArgument(format!(
                        "unknown implementation `{s}` (reference|cpu|cpu-workspace|cuda|torch|ring-<strategy>)"
                    )));
                }
            },
        })
    }
}

impl Named for Implementation {
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn from_name(s: &str) -> Result<Self> {
        Implementation::parse(s)
    }
}

impl std::fmt::Display for Implementation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Serde of a [`Named`] value as its name (`#[serde(with = "named")]`).
pub mod named {
    use super::*;

    pub fn serialize<T: Named, S: Serializer>(v: &T, s: S) -> std::result::Result<S::Ok, S::Error> {
        v.name().serialize(s)
    }

    pub fn deserialize<'de, T: Named, D: Deserializer<'de>>(d: D) -> std::result::Result<T, D::Error> {
        let s = String::deserialize(d)?;
        T::from_name(&s).map_err(serde::de::Error::custom)
    }
}

/// Serde of an optional [`Named`] value as its name or `null`.
pub mod named_opt {
    use super::*;

    pub fn serialize<T: Named, S: Serializer>(v: &Option<T>, s: S) -> std::result::Result<S::Ok, S::Error> {
        v.map(Named::name).serialize(s)
    }

    pub fn deserialize<'de, T: Named, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<T>, D::Error> {
        Option::<String>::deserialize(d)?.map(|s| T::from_name(&s).map_err(serde::de::Error::custom)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_implementation_name_parses_back() {
        let all = [
            Implementation::Reference,
            Implementation::Cpu,
            Implementation::CpuWorkspace,
            Implementation::Cuda,
            Implementation::Torch,
            Implementation::Ring(Strategy::Auto),
            Implementation::Ring(Strategy::Ring),
            Implementation::Ring(Strategy::AllGather),
        ];
        for imp in all {
            assert_eq!(Implementation::parse(imp.as_str()).unwrap(), imp);
        }
        assert_eq!(Implementation::parse("ring").unwrap(), Implementation::Ring(Strategy::Auto));
        for bad in ["gpu", "ring-zigzag", "CPU", ""] {
            let e = Implementation::parse(bad).unwrap_err().to_string();
            assert!(e.contains("unknown"), "{bad}: {e}");
        }
    }

    #[test]
    fn names_round_trip_through_json_and_bad_names_are_errors() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Row {
            #[serde(with = "named")]
            dtype: DType,
            #[serde(with = "named_opt")]
            layout: Option<Layout>,
        }
        let row = Row { dtype: DType::BF16, layout: Some(Layout::Zigzag) };
        let text = serde_json::to_string(&row).unwrap();
        assert_eq!(text, r#"{"dtype":"bf16","layout":"zigzag"}"#);
        assert_eq!(serde_json::from_str::<Row>(&text).unwrap(), row);
        let none: Row = serde_json::from_str(r#"{"dtype":"f32","layout":null}"#).unwrap();
        assert_eq!(none, Row { dtype: DType::F32, layout: None });
        let e = serde_json::from_str::<Row>(r#"{"dtype":"f8","layout":null}"#).unwrap_err().to_string();
        assert!(e.contains("unknown dtype `f8`"), "{e}");
    }
}

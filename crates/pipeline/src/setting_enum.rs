//! `setting_enum!`: an experiment setting that is one of a few words
//! (`device.kind`, `data.format`, `memory.oom_policy`) as a Rust enum.
//!
//! The enum reads and writes the same word the TOML holds, so a run's
//! recorded `config.toml`, its fingerprint and its checkpoints' headers are
//! the same as when these settings were strings; a word it does not know is
//! refused while the experiment is read, with every word it knows.

/// `expected "a", "b" or "c", got "x"`.
pub(crate) fn one_of(names: &[&str], got: &str) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    let list = match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        Some((last, _)) => last.clone(),
        None => String::new(),
    };
    format!("expected {list}, got \"{got}\"")
}

macro_rules! setting_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$variant_meta:meta])* $variant:ident = $text:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$variant_meta])* $variant,)+
        }

        impl $name {
            /// Every word this setting takes, in the order the docs give.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The word the TOML holds.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }

            /// One of [`Self::NAMES`]; `key` names the setting in the error.
            pub fn parse(key: &str, text: &str) -> $crate::Result<Self> {
                match text {
                    $($text => Ok(Self::$variant),)+
                    other => Err($crate::PipelineError::value(
                        key,
                        $crate::setting_enum::one_of(Self::NAMES, other),
                    )),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(
                &self,
                serializer: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(
                deserializer: D,
            ) -> std::result::Result<Self, D::Error> {
                let text = <String as serde::Deserialize>::deserialize(deserializer)?;
                match text.as_str() {
                    $($text => Ok(Self::$variant),)+
                    other => Err(<D::Error as serde::de::Error>::custom(
                        $crate::setting_enum::one_of(Self::NAMES, other),
                    )),
                }
            }
        }
    };
}

pub(crate) use setting_enum;

#[cfg(test)]
mod tests {
    use super::one_of;

    #[test]
    fn the_expected_words_read_as_a_list() {
        assert_eq!(one_of(&["a"], "x"), "expected \"a\", got \"x\"");
        assert_eq!(
            one_of(&["a", "b"], "x"),
            "expected \"a\" or \"b\", got \"x\""
        );
        assert_eq!(
            one_of(&["a", "b", "c"], "x"),
            "expected \"a\", \"b\" or \"c\", got \"x\""
        );
    }
}

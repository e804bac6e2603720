//! Commands printed for the user to paste into a POSIX shell (`continue
//! with: cargo xtask train --resume RUN_DIR`): every word that is not
//! plainly safe is single-quoted, so a path with spaces, quotes, `$`, a
//! glob or non-ASCII characters pastes as the one argument it is.

use std::borrow::Cow;
use std::path::Path;

/// `word` as one shell word: unchanged when it holds only characters no
/// POSIX shell treats specially anywhere in a word, else in single quotes
/// (inside which nothing is special), each `'` written as `'\''`.
///
/// The plain set is deliberately small: ASCII letters, digits and
/// `_ . / = : , + - @ %`. Everything else is quoted, including `~` (tilde
/// expansion), `#` (a comment at a word's start), `*?[` (globs), `{}`
/// (brace expansion), `!` (history), and all non-ASCII text, whose meaning
/// would depend on the shell's locale.
pub fn quote(word: &str) -> Cow<'_, str> {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_./=:,+-@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        return Cow::Borrowed(word);
    }
    let mut quoted = String::with_capacity(word.len() + 2);
    quoted.push('\'');
    for c in word.chars() {
        if c == '\'' {
            // Close the quote, an escaped quote, reopen.
            quoted.push_str("'\\''");
        } else {
            quoted.push(c);
        }
    }
    quoted.push('\'');
    Cow::Owned(quoted)
}

/// A path as one shell word. A path that is not UTF-8 is shown lossily
/// (the replacement character is quoted like any other): there is no
/// portable POSIX spelling of arbitrary bytes.
pub fn quote_path(path: &Path) -> String {
    quote(&path.to_string_lossy()).into_owned()
}

/// The words joined into one command line, each quoted as needed.
pub fn command<'a>(words: impl IntoIterator<Item = &'a str>) -> String {
    words.into_iter().map(quote).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `sh` makes of `line`: its arguments, one per line of output.
    fn shell_words(line: &str) -> Vec<String> {
        let output = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("for a in {line}; do printf '%s\\0' \"$a\"; done"))
            .output()
            .expect("run sh");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout)
            .unwrap()
            .split_terminator('\0')
            .map(String::from)
            .collect()
    }

    #[test]
    fn plain_words_stay_as_they_are() {
        for word in [
            "runs/smoke-20261121-085856",
            "run.output_dir=/tmp/x",
            "a,b:c+d@e%f",
        ] {
            assert!(matches!(quote(word), Cow::Borrowed(_)), "{word}");
        }
    }

    #[test]
    fn special_words_are_quoted_and_the_shell_reads_them_back() {
        let words = [
            "runs/with space",
            "it's",
            "'",
            "$HOME and `date` and $(id)",
            "naïve/läuft/訓練",
            "*.ckpt",
            "~/runs",
            "#hash",
            "tab\tnewline\nend",
            "back\\slash\"double",
            "",
        ];
        for word in words {
            let quoted = quote(word);
            assert!(quoted.starts_with('\''), "{word:?} -> {quoted}");
            assert_eq!(shell_words(&quoted), [word], "{word:?} -> {quoted}");
        }
        let line = command(words);
        assert_eq!(shell_words(&line), words, "{line}");
    }

    #[test]
    fn a_single_quote_is_closed_escaped_and_reopened() {
        assert_eq!(quote("it's"), "'it'\\''s'");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote(""), "''");
    }
}

//! JSONL fine-tuning data on the llama fixture's tokenizer (no BOS from its
//! post-processor; EOS id 0 from config.json): labels, EOS, truncation,
//! packing, and bad lines named by file, line and key.

mod common;

use common::*;
use headroom_llm::data::{load_jsonl, DataOptions};
use headroom_llm::{Model, Tokenizer};

fn write(dir: &tempfile::TempDir, text: &str) -> std::path::PathBuf {
    let path = dir.path().join("train.jsonl");
    std::fs::write(&path, text).expect("write");
    path
}

fn setup() -> (Tokenizer, Option<u32>) {
    let model = Model::load(&fixture("llama")).expect("loads");
    let tok = Tokenizer::load(&fixture("llama")).expect("tokenizer");
    (tok, model.config.eos_token_ids.first().copied())
}

#[test]
fn text_and_prompt_completion_rows() {
    let (tok, eos) = setup();
    assert_eq!(eos, Some(0));
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = write(
        &tmp,
        "{\"text\": \"The lazy fox\"}\n\n{\"prompt\": \"The quick\", \"completion\": \" brown fox\"}\n",
    );
    let data = load_jsonl(&path, &tok, eos, DataOptions::default()).expect("loads");
    assert_eq!(
        (data.examples.len(), data.truncated, data.dropped),
        (2, 0, 0)
    );
    let text = &data.examples[0];
    let ids = tok.encode("The lazy fox").expect("encode");
    assert_eq!(text.ids[..ids.len()], ids[..]);
    assert_eq!(text.ids.last(), Some(&0), "EOS appended");
    assert_eq!(text.ids.len(), ids.len() + 1);
    assert!(text
        .ids
        .iter()
        .zip(&text.labels)
        .all(|(&i, &l)| i64::from(i) == l));

    let pc = &data.examples[1];
    let prompt = tok.encode("The quick").expect("encode");
    let completion = tok.encode_with(" brown fox", false).expect("encode");
    assert_eq!(pc.ids.len(), prompt.len() + completion.len() + 1);
    assert!(
        pc.labels[..prompt.len()].iter().all(|&l| l == -100),
        "no loss on the prompt"
    );
    assert_eq!(pc.labels[prompt.len()], i64::from(completion[0]));
    assert_eq!(pc.labels.last(), Some(&0));
}

#[test]
fn truncation_is_counted_and_packing_cuts_rows() {
    let (tok, eos) = setup();
    let tmp = tempfile::tempdir().expect("tempdir");
    let long = TEXT.repeat(3);
    let path = write(
        &tmp,
        &format!("{{\"text\": \"{long}\"}}\n{{\"text\": \"fox\"}}\n{{\"prompt\": \"{long}\", \"completion\": \"done\"}}\n"),
    );
    let options = DataOptions {
        max_seq_length: 8,
        packing: false,
    };
    let data = load_jsonl(&path, &tok, eos, options).expect("loads");
    // The long prompt fills its 8 tokens: nothing left to learn, dropped.
    assert_eq!(
        (data.examples.len(), data.truncated, data.dropped),
        (2, 2, 1)
    );
    assert!(data.examples.iter().all(|e| e.ids.len() <= 8));

    let packed = load_jsonl(
        &path,
        &tok,
        eos,
        DataOptions {
            max_seq_length: 8,
            packing: true,
        },
    )
    .expect("loads");
    let plain = load_jsonl(&path, &tok, eos, DataOptions::default()).expect("loads");
    assert_eq!(plain.examples.len(), 3, "all fit in 1024");
    let total: usize = plain.examples.iter().map(|e| e.ids.len()).sum();
    assert!(packed.examples.iter().all(|e| e.ids.len() <= 8));
    assert!(packed
        .examples
        .iter()
        .rev()
        .skip(1)
        .all(|e| e.ids.len() == 8));
    assert_eq!(packed.truncated, 0);
    let packed_total: usize = packed.examples.iter().map(|e| e.ids.len()).sum();
    // Every token is in some row; rows with no label (inside the long
    // prompt) are dropped, all full but perhaps the last.
    assert!(packed.dropped >= 1, "the long prompt's rows teach nothing");
    let cut = packed_total + 8 * packed.dropped;
    assert!(
        cut >= total && cut < total + 8,
        "{packed_total} + dropped of {total}"
    );
    let ids: Vec<u32> = plain.examples.iter().flat_map(|e| e.ids.clone()).collect();
    assert_eq!(packed.examples[0].ids[..], ids[..8]);
}

#[test]
fn bad_lines_name_file_line_and_key() {
    let (tok, eos) = setup();
    let tmp = tempfile::tempdir().expect("tempdir");
    let cases = [
        ("{\"text\": \"ok\"}\nnot json\n", "line 2", "JSON"),
        ("{\"text\": 3}\n", "line 1", "`text` is not a string"),
        ("{\"prompt\": \"a\"}\n", "line 1", "`completion` is missing"),
        ("{\"completion\": \"a\"}\n", "line 1", "`prompt` is missing"),
        ("{\"txt\": \"a\"}\n", "line 1", "no key `text`"),
        (
            "{\"text\": \"a\", \"prompt\": \"b\", \"completion\": \"c\"}\n",
            "line 1",
            "one form",
        ),
        ("\n\n", "line 0", "no examples"),
    ];
    for (body, line, what) in cases {
        let path = write(&tmp, body);
        let e = load_jsonl(&path, &tok, eos, DataOptions::default())
            .expect_err(body)
            .to_string();
        assert!(
            e.contains("train.jsonl") && e.contains(line) && e.contains(what),
            "{body:?}: {e}"
        );
    }
}

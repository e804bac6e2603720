//! A `DataLoader`'s settings checked against its dataset before any
//! thread starts: each refusal names the setting and what it allows, and
//! what passes becomes the loader's shared state.

use super::*;

pub(super) fn config_err(field: &'static str, message: String) -> LoaderError {
    LoaderError::Config { field, message }
}

pub(super) fn validate(
    dataset: Arc<dyn Dataset>,
    config: LoaderConfig,
) -> Result<Shared, LoaderError> {
    if config.batch_size == 0 {
        return Err(config_err("batch_size", "must be > 0".into()));
    }
    if config.prefetch == 0 || config.prefetch > MAX_PREFETCH {
        return Err(config_err(
            "prefetch",
            format!("must be in 1..={MAX_PREFETCH}, got {}", config.prefetch),
        ));
    }
    if config.workers > MAX_WORKERS {
        return Err(config_err(
            "workers",
            format!("must be at most {MAX_WORKERS}, got {}", config.workers),
        ));
    }
    if config.timeout.is_zero() {
        return Err(config_err("timeout", "must be > 0".into()));
    }
    let shape = dataset.sample_shape();
    let kind = dataset.sample_kind();
    validate_kind(&kind, &config)?;
    let sample_len = kind
        .record_len(shape)
        .filter(|_| shape.iter().all(|&d| d > 0))
        .ok_or_else(|| {
            config_err(
                "dataset",
                format!("sample shape {shape:?} (h, w, c) must be non-zero and fit in memory"),
            )
        })?;
    if sample_len.checked_mul(config.batch_size).is_none() {
        return Err(config_err(
            "batch_size",
            format!(
                "{} samples of {sample_len} bytes overflow",
                config.batch_size
            ),
        ));
    }
    let len = dataset.len();
    let num_classes = dataset.num_classes();
    if len > 0 && num_classes == 0 {
        return Err(config_err(
            "dataset",
            format!("{len} samples but num_classes = 0"),
        ));
    }
    if config.shuffle && u32::try_from(len).is_err() {
        return Err(config_err(
            "shuffle",
            format!("shuffling supports at most 2^32 - 1 samples, the dataset has {len}"),
        ));
    }
    let augment = &config.augment;
    if let Some(ra) = &augment.rand_augment {
        if ra.magnitude > MAX_MAGNITUDE {
            return Err(config_err(
                "augment.rand_augment.magnitude",
                format!("must be in 0..={MAX_MAGNITUDE}, got {}", ra.magnitude),
            ));
        }
        if ra.num_ops > MAX_NUM_OPS {
            return Err(config_err(
                "augment.rand_augment.num_ops",
                format!("must be in 0..={MAX_NUM_OPS}, got {}", ra.num_ops),
            ));
        }
    }
    for (field, alpha) in [
        ("augment.mixup_alpha", augment.mixup_alpha),
        ("augment.cutmix_alpha", augment.cutmix_alpha),
    ] {
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(config_err(
                field,
                format!("must be a finite number >= 0 (0 = off), got {alpha}"),
            ));
        }
    }
    if config.resident {
        validate_resident(&config, len)?;
    }
    let pad = config.augment.crop_padding;
    if pad > shape[0] || pad > shape[1] {
        return Err(config_err(
            "augment.crop_padding",
            format!(
                "{pad} is larger than the {} x {} samples",
                shape[0], shape[1]
            ),
        ));
    }
    if config.drop_last && len > 0 && config.batch_size > len {
        return Err(config_err(
            "batch_size",
            format!(
                "{} is larger than the dataset ({len} samples): with drop_last an epoch would \
                 have no batch",
                config.batch_size
            ),
        ));
    }
    let shard = config.shard;
    if shard.world == 0 || shard.rank >= shard.world {
        return Err(config_err(
            "shard",
            format!("rank {} of a world of {}", shard.rank, shard.world),
        ));
    }
    if shard.world > 1 && !config.drop_last {
        return Err(config_err(
            "shard",
            "a loader shared by ranks must drop the last incomplete batch (drop_last), so that \
             every rank has the same batches"
                .into(),
        ));
    }
    let global_batch = config.batch_size.saturating_mul(shard.world);
    if shard.world > 1 && len > 0 && global_batch > len {
        return Err(config_err(
            "batch_size",
            format!(
                "{} per rank × {} ranks is larger than the dataset ({len} samples): an epoch \
                 would have no batch",
                config.batch_size, shard.world
            ),
        ));
    }
    let batches = if config.drop_last {
        len / global_batch
    } else {
        len.div_ceil(config.batch_size)
    };
    let layout = dataset.shard_layout();
    if let Some(l) = &layout {
        let total: usize = l.shard_lens.iter().sum();
        if total != len {
            return Err(config_err(
                "dataset",
                format!("its shard layout covers {total} samples but it has {len}"),
            ));
        }
    }
    let bs = config.batch_size as u64;
    // A resident batch carries a recipe where a sample's pixels would be.
    let per_sample = if config.resident {
        std::mem::size_of::<SampleRecipe>()
    } else {
        sample_len
    };
    let batch_bytes = bs * per_sample as u64
        + 4 * bs
        + if config.augment.mixes() {
            4 * bs * num_classes as u64
        } else {
            0
        };
    let in_flight = if config.workers == 0 {
        1
    } else {
        config.prefetch as u64
    };
    let cache = dataset.memory_limit();
    let limit_bytes = cache.saturating_add(in_flight.saturating_mul(batch_bytes));
    if let Some(budget) = config.memory_budget {
        if limit_bytes > budget {
            return Err(config_err(
                "memory_budget",
                format!(
                    "loader.memory_budget = {budget} bytes cannot hold the dataset's cache \
                     ({cache} bytes) + {in_flight} batch(es) in flight x {batch_bytes} bytes \
                     = {limit_bytes} bytes: raise the budget, or lower the cache, prefetch or \
                     batch size"
                ),
            ));
        }
    }
    Ok(Shared {
        dataset,
        config,
        shape,
        sample_len,
        kind,
        num_classes,
        len,
        batches,
        layout,
        batch_bytes,
        limit_bytes,
        inflight: Arc::default(),
    })
}

/// Samples that are not u8 images, or carry numeric targets, are moved as
/// they are: the augmentations (which draw on pixels and mix labels) and a
/// device-resident copy (which holds u8 pixels) do not apply to them.
fn validate_kind(kind: &SampleKind, config: &LoaderConfig) -> Result<(), LoaderError> {
    if *kind == SampleKind::default() {
        return Ok(());
    }
    if !kind.value_scale.is_empty() && kind.value_scale.len() != kind.values {
        return Err(config_err(
            "dataset",
            format!(
                "{} target scales for {} numeric targets",
                kind.value_scale.len(),
                kind.values
            ),
        ));
    }
    let what = match kind.element {
        Element::F32 => "f32 features",
        Element::U8 => "numeric targets",
    };
    let augment = &config.augment;
    let on = [
        ("augment.crop_padding", augment.crop_padding > 0),
        ("augment.flip", augment.flip),
        (
            "augment.rand_augment",
            augment.rand_augment.is_some_and(|r| r.num_ops > 0),
        ),
        ("augment.mixup_alpha", augment.mixup_alpha > 0.0),
        ("augment.cutmix_alpha", augment.cutmix_alpha > 0.0),
    ];
    if let Some((field, _)) = on.iter().find(|(_, on)| *on) {
        return Err(config_err(
            field,
            format!(
                "applies to u8 images with class labels, and this dataset holds {what}: \
                 turn it off"
            ),
        ));
    }
    if config.resident {
        return Err(config_err(
            "resident",
            format!(
                "a dataset resident on the device holds u8 images, and this one holds {what}: \
                 keep the data on the host (data.on_device = false)"
            ),
        ));
    }
    Ok(())
}

/// What a batch of [`SampleRecipe`]s can describe: crop and flip of at
/// most 2^32 samples.
fn validate_resident(config: &LoaderConfig, len: usize) -> Result<(), LoaderError> {
    let augment = &config.augment;
    if let Some(field) = augment.host_only_key() {
        return Err(config_err(
            field,
            "is applied on the host, so it cannot be used with a dataset resident on the \
             device (only crop and flip are): turn it off, or keep the data on the host \
             (data.on_device = false)"
                .into(),
        ));
    }
    if augment.crop_padding > usize::from(u8::MAX) / 2 {
        return Err(config_err(
            "augment.crop_padding",
            format!(
                "{} is more than a resident dataset's crops allow (127)",
                augment.crop_padding
            ),
        ));
    }
    if u32::try_from(len).is_err() {
        return Err(config_err(
            "dataset",
            format!("a resident dataset holds at most 2^32 - 1 samples, this one has {len}"),
        ));
    }
    Ok(())
}

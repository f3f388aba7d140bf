//! The `log` dataplane (`mcs-agent run --dataplane log`): programs nothing, logs what it would
//! program and keeps the table.

use mcs_model::{Dataplane, DataplaneError, TableDiff, input::escaped};

/// A dataplane that only logs what it would program and keeps the table.
#[derive(Debug, Default)]
pub struct LogDataplane {
    table: mcs_model::ForwardingTable,
}

impl LogDataplane {
    /// What it holds.
    pub fn table(&self) -> &mcs_model::ForwardingTable {
        &self.table
    }
}

impl Dataplane for LogDataplane {
    fn name(&self) -> &'static str {
        "log"
    }

    fn apply(&mut self, diff: &TableDiff) -> Result<(), DataplaneError> {
        for f in &diff.remove {
            tracing::info!(frontend = %f, "remove frontend");
        }
        // One line per frontend: made only when someone reads them (a full sync at 1M
        // endpoints would format every backend).
        if tracing::enabled!(tracing::Level::INFO) {
            for (f, s) in &diff.upsert {
                let selected: Vec<String> = s
                    .selected()
                    .map(|b| format!("{}:{}@{}", b.address, b.port, b.cluster))
                    .collect();
                tracing::info!(frontend = %f, service = %escaped(&s.service), backends = ?selected, "program frontend");
            }
        }
        self.table.apply(diff);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_table_it_was_given() {
        let mut table = mcs_model::ForwardingTable::default();
        let f = mcs_model::Frontend {
            vip: "198.18.100.1".parse().unwrap(),
            port: 80,
            protocol: mcs_model::Protocol::Tcp,
        };
        table.frontends.insert(
            f,
            std::sync::Arc::new(mcs_model::Service {
                service: "shop/web".into(),
                affinity: None,
                backends: Vec::new(),
            }),
        );
        let mut log = LogDataplane::default();
        log.apply(&mcs_model::diff(
            &mcs_model::ForwardingTable::default(),
            &table,
        ))
        .unwrap();
        assert_eq!(log.table(), &table);
        assert_eq!(log.name(), "log");
    }
}

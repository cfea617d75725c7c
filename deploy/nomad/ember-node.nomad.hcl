# Nomad system job: one `ember node` on every client whose meta has ember_kvm = "true" (add
# `meta { ember_kvm = "true" }` to the client block of those hosts, and enable raw_exec:
# `plugin "raw_exec" { config { enabled = true } }`). Secrets come from the Nomad variable
# nomad/jobs/ember-node (keys db_url, node_token, blob_url, aws_access_key_id,
# aws_secret_access_key, aws_region, aws_endpoint_url; see docs/deploy.md).
# Change: the binary's path if ember is not in /usr/local/bin; the port (7100) if taken.
job "ember-node" {
  type = "system"

  constraint {
    attribute = "${meta.ember_kvm}"
    value     = "true"
  }

  # One host at a time: each old allocation drains before it stops.
  update {
    max_parallel     = 1
    min_healthy_time = "30s"
    healthy_deadline = "10m"
  }

  group "node" {
    network {
      # The internal API, at the host's address (raw_exec tasks use the host's network).
      port "internal" {
        static = 7100
      }
    }

    # Unauthenticated /internal/v1/health answers 200 once the node is up. No check_restart:
    # a restart would drain the node (below); a failing check only marks it unhealthy.
    service {
      name     = "ember-node"
      provider = "nomad"
      port     = "internal"

      check {
        type     = "http"
        path     = "/internal/v1/health"
        interval = "10s"
        timeout  = "3s"
      }
    }

    task "node" {
      # raw_exec, not exec: the node needs root and the host itself (/dev/kvm,
      # /dev/net/tun, /dev/vhost-vsock, TAP devices, network namespaces, nftables,
      # cgroups, mount namespaces for its jails), all of which exec's isolation removes.
      # Each VMM is jailed by ember itself.
      driver = "raw_exec"

      # Nomad has no pre-stop hook, so the shell below is the task: it runs the node, and on
      # SIGTERM drains it (every sandbox paused, uploaded and continued elsewhere) before
      # passing SIGTERM on. kill_timeout is the time allowed for both; the VMMs, each in a
      # cgroup of its own outside the task's, are not killed with it.
      kill_signal  = "SIGTERM"
      kill_timeout = "300s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          /usr/local/bin/ember node \
            --internal-listen "$NOMAD_ADDR_internal" \
            --advertise "$NOMAD_ADDR_internal" \
            --node-token-file "$NOMAD_SECRETS_DIR/node-token" \
            --listen 127.0.0.1:7071 \
            --vmm-watchdog 5 &
          node=$!
          draining=
          trap 'draining=1; /usr/local/bin/ember cluster drain --db "$EMBER_DB" --wait "$EMBER_NODE_ID"; kill -TERM "$node"' TERM INT
          wait "$node"
          status=$?
          if [ -n "$draining" ]; then wait "$node"; status=$?; fi
          exit "$status"
          EOT
        ]
      }

      env {
        EMBER_NODE_ID = "${node.unique.name}"
        EMBER_HOME    = "/var/lib/ember"
        EMBER_CACHE   = "/var/cache/ember"
      }

      template {
        destination = "${NOMAD_SECRETS_DIR}/ember.env"
        env         = true
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/ember-node" -}}
          EMBER_DB={{ .db_url }}
          EMBER_BLOBS={{ .blob_url }}
          AWS_ACCESS_KEY_ID={{ .aws_access_key_id }}
          AWS_SECRET_ACCESS_KEY={{ .aws_secret_access_key }}
          AWS_REGION={{ .aws_region }}
          {{ if .aws_endpoint_url }}AWS_ENDPOINT_URL={{ .aws_endpoint_url }}{{ end }}
          {{- end }}
          EOT
      }

      template {
        destination = "${NOMAD_SECRETS_DIR}/node-token"
        perms       = "0600"
        data        = "{{ with nomadVar \"nomad/jobs/ember-node\" }}{{ .node_token }}{{ end }}"
      }

      # The node process alone: the VMMs are in cgroups of their own, with each sandbox's
      # limits. memory_max applies where the scheduler allows memory oversubscription.
      resources {
        cpu        = 500
        memory     = 512
        memory_max = 2048
      }
    }
  }
}

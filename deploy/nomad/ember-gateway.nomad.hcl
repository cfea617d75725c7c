# Nomad service job: two `ember gateway`s (stateless; clients may use either), registered as
# the Nomad service `ember-gateway` on a dynamic port, for a load balancer that reads Nomad's
# service catalog (Traefik, Fabio, HAProxy...). Secrets come from the Nomad variable
# nomad/jobs/ember-gateway (keys db_url, node_token, client_token; see docs/deploy.md).
# Change: count; the binary's path if ember is not in /usr/local/bin; add
# `--domain DOMAIN` to args if E2B clients address sandboxes by host name.
job "ember-gateway" {
  type = "service"

  group "gateway" {
    count = 2

    spread {
      attribute = "${node.unique.id}"
    }

    network {
      port "http" {}
    }

    service {
      name     = "ember-gateway"
      provider = "nomad"
      port     = "http"

      check {
        type     = "http"
        path     = "/healthz"
        interval = "10s"
        timeout  = "3s"

        check_restart {
          limit = 3
          grace = "30s"
        }
      }
    }

    task "gateway" {
      # exec: chrooted, its own PID namespace, no capabilities, as `nobody`; the gateway
      # needs nothing from the host but the network.
      driver = "exec"
      user   = "nobody"

      # Leave the service catalog first, then SIGTERM lets open streams go on for
      # --shutdown-grace (10 s by default).
      shutdown_delay = "5s"
      kill_timeout   = "30s"

      config {
        command = "/usr/local/bin/ember"
        args = [
          "gateway",
          "--listen", "0.0.0.0:${NOMAD_PORT_http}",
          "--token-file", "${NOMAD_SECRETS_DIR}/client-token",
          "--node-token-file", "${NOMAD_SECRETS_DIR}/node-token",
        ]
      }

      template {
        destination = "${NOMAD_SECRETS_DIR}/ember.env"
        env         = true
        # The directory; the blob store (artifacts of sandboxes whose node is gone).
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/ember-gateway" -}}
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
        destination = "${NOMAD_SECRETS_DIR}/client-token"
        perms       = "0400"
        uid         = 65534
        gid         = 65534
        data        = "{{ with nomadVar \"nomad/jobs/ember-gateway\" }}{{ .client_token }}{{ end }}"
      }

      template {
        destination = "${NOMAD_SECRETS_DIR}/node-token"
        perms       = "0400"
        uid         = 65534
        gid         = 65534
        data        = "{{ with nomadVar \"nomad/jobs/ember-gateway\" }}{{ .node_token }}{{ end }}"
      }

      resources {
        cpu    = 200
        memory = 256
      }
    }
  }
}

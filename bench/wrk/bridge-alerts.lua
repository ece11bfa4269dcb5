counter = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench-token"
request = function()
  counter = counter + 1
  local fp = string.format("%08x%04x", math.random(0, 2147483647), counter)
  local body = '{"version":"4","groupKey":"{}:{run=\\"r\\"}","status":"firing","receiver":"bridge","groupLabels":{"run":"r"},"commonLabels":{},"commonAnnotations":{},"externalURL":"http://am","truncatedAlerts":0,"alerts":[{"status":"firing","labels":{"alertname":"Bench","run":"r","action":"checkpoint"},"annotations":{},"startsAt":"2026-12-02T10:00:00Z","endsAt":"0001-01-01T00:00:00Z","generatorURL":"","fingerprint":"' .. fp .. '"}]}'
  return wrk.format(nil, "/api/v1/alerts", nil, body)
end

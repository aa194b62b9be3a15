mkdir -p logs
for i in 1 2 3 4 5 6; do echo "job $i started" > "logs/job$i.log"; done
echo "ERROR disk full" >> logs/job2.log
echo "ERROR timeout" >> logs/job5.log
echo "finished" >> logs/job3.log
